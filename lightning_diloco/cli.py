"""The ``lightning-diloco`` command."""

from __future__ import annotations

import argparse
import difflib
import sys

from lightning_diloco import __version__


def _synchronizer(args: argparse.Namespace) -> int:
    from lightning_diloco.synchronizer.main import run_synchronizer

    return run_synchronizer(args)


def _run(args: argparse.Namespace) -> int:
    from lightning_diloco.launch.run import RunOptions, run

    return run(RunOptions.from_args(args), args.command_line)


def _status(args: argparse.Namespace) -> int:
    from lightning_diloco.synchronizer.main import run_status

    return run_status(args)


def _credential(args: argparse.Namespace) -> int:
    from lightning_diloco.core.token_options import resolve_token
    from lightning_diloco.synchronizer.credentials import island_credential

    token = resolve_token(args)
    if not token:
        raise ValueError("no run token: pass --token-file (or set $DILOCO_TOKEN) to the synchronizer's token")
    print(island_credential(token, args.island))
    return 0


def _export(args: argparse.Namespace) -> int:
    from lightning_diloco.core.token_options import resolve_token
    from lightning_diloco.learner.export import export, read_global_model

    if args.synchronizer:
        model = read_global_model(synchronizer=args.synchronizer, token=resolve_token(args), tls_root_cert=args.tls_root_cert)
    else:
        model = read_global_model(checkpoint_dirs=args.checkpoint_dir)
    summary = export(model, args.out, hf_config=args.hf_config, prefix=args.prefix)
    versions = sorted(set(model.versions.values()))
    print(f"exported run {model.run_id}: {summary['tensors']} tensors, fragment versions {versions[0]} to {versions[-1]}, "
          f"into {args.out} ({', '.join(k for k in ('state_dict', 'hugging_face') if k in summary)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-diloco",
        description="Decoupled DiLoCo for PyTorch Lightning: resilient, low-bandwidth training across learner islands.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-diloco {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from lightning_diloco.synchronizer.main import add_synchronizer_arguments

    sync = commands.add_parser("synchronizer", help="run a synchronizer (shard) that islands join over gRPC")
    add_synchronizer_arguments(sync)
    sync.set_defaults(run=_synchronizer)

    from lightning_diloco.launch.options import add_run_arguments

    run = commands.add_parser(
        "run", help="run a synchronizer and M islands of COMMAND on this host (after --)",
        usage="lightning-diloco run [OPTIONS] -- COMMAND [ARGS ...]",
        description="Run a synchronizer and M islands, each COMMAND in its own process tree, e.g. "
                    "lightning-diloco run --islands 3 -- python examples/train_lm.py --steps 300",
    )
    add_run_arguments(run)
    from lightning_diloco.launch.report import definitions_help

    run.formatter_class, run.epilog = argparse.RawDescriptionHelpFormatter, definitions_help()
    run.set_defaults(run=_run)

    status = commands.add_parser("status", help="print a synchronizer's status as a table")
    status.add_argument("address", help="host:port, comma-separated for every shard")
    from lightning_diloco.core.token_options import add_token_arguments

    add_token_arguments(status, "run's token")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.set_defaults(run=_status)

    credential = commands.add_parser(
        "credential", help="print the credential of one island, derived from the run's token",
        description="Print island I's credential: it authenticates as island I only (give it to that island as "
                    "DILOCO_TOKEN); the run's token itself acts as every island, keep it to the operator.")
    credential.add_argument("--island", type=int, required=True, help="the island's index I (>= 0)")
    add_token_arguments(credential, "run's token")
    credential.set_defaults(run=_credential)

    exporting = commands.add_parser(
        "export", help="write the global model from a running synchronizer or its checkpoint directories",
        description="Write the run's global model into OUT: state_dict.pt (each tensor by the trained module's "
                    "parameter name, fp32), with --hf-config a Hugging Face folder OUT/hf, and export.json. Read "
                    "from a running synchronizer (every shard, with the run's token; the run is not disturbed) or "
                    "from every shard's checkpoint directory (the run need not be alive).")
    source = exporting.add_mutually_exclusive_group(required=True)
    source.add_argument("--synchronizer", metavar="HOST:PORT[,...]", help="every shard's address, in shard order")
    source.add_argument("--checkpoint-dir", nargs="+", metavar="DIR", help="every shard's --checkpoint-dir")
    exporting.add_argument("--out", required=True, help="the folder to write into")
    exporting.add_argument("--hf-config", help="a Hugging Face config.json (or its folder) of the trained model: "
                           "also write OUT/hf with save_pretrained")
    exporting.add_argument("--prefix", help="the trained module's attribute path of the Hugging Face model, with its "
                           "dot (e.g. 'model.'); default: the one under which the run's tensors are the model's")
    exporting.add_argument("--tls-root-cert", help="the synchronizer's TLS root certificate (PEM), when it serves TLS")
    add_token_arguments(exporting, "run's token (the operator's)")
    exporting.set_defaults(run=_export)
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> str:
    """argparse's "unrecognized arguments", plus the flag a misspelt one was probably meant to
    be, or, for `run`, that the training command goes after --."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    for word in unknown:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    if command == "run" and not unknown[0].startswith("-"):
        return (f"{message}: the training command goes after --, e.g. "
                f"lightning-diloco run --islands 2 -- {' '.join(unknown)}")
    return message


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line: list[str] = []
    if "--" in argv:  # everything after -- is the island command, never our options
        split = argv.index("--")
        argv, command_line = argv[:split], argv[split + 1 :]
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand that was given them, with what was probably meant
        given = _subcommand(parser, args.command)
        given.error(_unrecognized(given, args.command, unknown))
    args.command_line = command_line
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except ValueError as err:  # a bad setting: the message names it and the fix
        parser.exit(2, f"lightning-diloco {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
