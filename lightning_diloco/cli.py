"""The ``lightning-diloco`` command."""

from __future__ import annotations

import argparse
import sys

from lightning_diloco import __version__


def _demo(args: argparse.Namespace) -> int:
    from lightning_diloco.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-diloco",
        description="Decoupled DiLoCo for PyTorch Lightning: resilient, low-bandwidth training across learner islands.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-diloco {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="a short CPU demonstration of what exists")
    demo.add_argument("--islands", type=int, default=4, help="learner islands (default 4)")
    demo.add_argument("--steps", type=int, default=240, help="inner steps per island (default 240)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
