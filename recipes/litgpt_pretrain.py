"""LitGPT recipe: a LitGPT model (built from a ``litgpt.Config``, nothing downloaded) pretrained by a
Fabric loop as M Decoupled DiLoCo islands, against the same model and loop under Fabric's DDP of M
ranks, at equal tokens.

    python -m recipes.litgpt_pretrain                       # 2 islands against DDP of 2 ranks
    python -m recipes.litgpt_pretrain --islands 4 --seed 1 --n-embd 128

The model is LitGPT's ``GPT`` with a Llama-style config (RMSNorm, LLaMA MLP, grouped-query
attention, rotary embeddings, no biases), initialized as ``litgpt pretrain`` initializes it
(``litgpt.pretrain.initialize_weights``) but not ``torch.compile``d. The loop, the data (the
Shakespeare works in byte tokens, the text recipes') and the arms' processes are
``recipes/fabric_arms.py``'s: each island or DDP rank trains ``--steps`` batches of 16 x 64 tokens
of its 1/M of the training works. Printed and in OUT/result.json: the eval loss on held-out works
of the synchronizer's global model against DDP's model and the untrained model's, the rounds'
health, and the step-time ratio (median island step / median DDP step, the same processes).

``litgpt pretrain`` itself cannot run the islands: its ``setup`` builds its own Fabric with a
strategy it picks (FSDP for more than one device, else "auto") and takes none.

LitGPT is installed apart from the package's extras (``scripts/setup.sh``: ``pip install --no-deps
litgpt==0.5.13``): its pins would downgrade huggingface-hub and jsonargparse under transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_diloco.core.config import RunConfig  # noqa: E402
from lightning_diloco.core.presets import small_text_model  # noqa: E402
from recipes import fabric_arms  # noqa: E402

MODULE = "recipes.litgpt_pretrain"
VOCAB = 256  # byte tokens
LITGPT = "litgpt==0.5.13"


def _litgpt():
    try:
        import litgpt
    except ImportError as e:
        raise SystemExit(f"this recipe needs LitGPT ({e}); install it without its pins, which would downgrade "
                         f"transformers' dependencies: pip install --no-deps {LITGPT} psutil (scripts/setup.sh does)") from e
    return litgpt


def litgpt_config(n_layer: int, n_embd: int):
    """A Llama-style ``litgpt.Config`` of ``n_layer`` blocks of width ``n_embd``: heads of 16, two
    query heads per key-value head, an MLP three times as wide."""
    if n_embd <= 0 or n_embd % 32 or n_layer <= 0:
        raise SystemExit(f"--n-embd must be a positive multiple of 32 (heads of 16, in pairs) and --n-layer positive; "
                         f"got --n-embd {n_embd} --n-layer {n_layer}")
    return _litgpt().Config(
        name=f"diloco-{n_layer}x{n_embd}", block_size=fabric_arms.SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB,
        n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 16, n_query_groups=n_embd // 32, intermediate_size=3 * n_embd,
        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False, parallel_residual=False, rotary_percentage=1.0,
    )


class LitGPTLoss(nn.Module):
    """LitGPT's ``GPT`` with its next-token loss as ``forward``: the model the arms train."""

    def __init__(self, config) -> None:
        super().__init__()
        from litgpt.model import GPT

        self.gpt = GPT(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(input_ids)[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())


class _Unsharded:
    """What ``litgpt.pretrain.initialize_weights`` asks of its Fabric: only whether the strategy
    shards the model (FSDP defers the init); here every process holds all of it."""

    strategy = None


def build_model(n_layer: int, n_embd: int, seed: int) -> LitGPTLoss:
    """The model every island and rank starts from: ``seed``'s GPT-NeoX init, as ``litgpt pretrain``'s."""
    from litgpt.pretrain import initialize_weights

    config = litgpt_config(n_layer, n_embd)
    torch.manual_seed(seed)
    model = LitGPTLoss(config)
    initialize_weights(_Unsharded(), model.gpt, n_layer=config.n_layer, n_embd=config.n_embd)
    return model


def run_config() -> RunConfig:
    return small_text_model(8)  # the text recipes' CPU settings; the 2-layer model has 17 tensors


def summarize(args: argparse.Namespace, untrained: float, ddp: dict, islands: dict, params: int) -> dict:
    island_step = statistics.median(r["median_step_s"] for r in islands["islands"])
    diloco = [r["diloco"] for r in islands["islands"]]
    return {
        "recipe": "litgpt_pretrain", "model": litgpt_config(args.n_layer, args.n_embd).name, "params": params,
        "islands": args.islands, "seed": args.seed, "steps": args.steps,
        "eval_loss": {"islands": islands["eval_loss"], "ddp": ddp["eval_loss"], "untrained": untrained},
        "gap": islands["eval_loss"] / ddp["eval_loss"] - 1,
        "tokens": {"islands": sum(r["tokens"] for r in islands["islands"]), "ddp": ddp["tokens"]},
        "step_s": {"island": island_step, "ddp": ddp["median_step_s"]},
        "step_time_ratio": island_step / ddp["median_step_s"],
        "bytes_across_islands": sum(d.get("diloco/bytes_up", 0) + d.get("diloco/bytes_down", 0) for d in diloco),
        "rounds_health": islands["rounds_health"],
    }


def format_summary(s: dict, out: Path) -> str:
    from lightning_diloco.launch.report import format_rounds

    loss = s["eval_loss"]
    return "\n".join([
        f"litgpt_pretrain ({s['model']}, {s['params'] / 1e6:.2f}M parameters, M={s['islands']}, seed {s['seed']}): "
        f"eval loss {loss['islands']:.4f} (global model of {s['islands']} islands) against DDP's {loss['ddp']:.4f} "
        f"({s['islands']} ranks): {100 * s['gap']:+.1f}%; untrained {loss['untrained']:.4f}",
        "  " + format_rounds(s["rounds_health"]),
        f"  step time: island {1000 * s['step_s']['island']:.1f} ms, DDP rank {1000 * s['step_s']['ddp']:.1f} ms "
        f"(medians), ratio {s['step_time_ratio']:.3f}",
        f"  tokens: islands {s['tokens']['islands']:,}, DDP {s['tokens']['ddp']:,}; bytes across islands "
        f"{s['bytes_across_islands'] / 1e6:.2f} MB (measured)",
        f"  results in {out}: result.json, each process's figures arms/*.json",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands", type=int, default=2, help="M: islands, and DDP ranks (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the initial weights and the data order (default %(default)s)")
    p.add_argument("--steps", type=int, default=400, help="batches per island and per DDP rank (default %(default)s)")
    p.add_argument("--n-layer", type=int, default=2, help="LitGPT blocks (default %(default)s)")
    p.add_argument("--n-embd", type=int, default=64, help="width, a multiple of 32 (default %(default)s)")
    p.add_argument("--out", default="runs/litgpt_pretrain", help="(default %(default)s)")
    fabric_arms.child_arguments(p)
    args = p.parse_args(argv)
    if args.islands < 1 or args.steps <= 10:
        p.error(f"--islands must be at least 1 and --steps more than 10 (the first 10 are the step time's warm-up); "
                f"got --islands {args.islands} --steps {args.steps}")
    build = partial(build_model, args.n_layer, args.n_embd)
    if args.role:
        fabric_arms.run_child(args, build, run_config())
        return 0
    out = Path(args.out)
    (out / "arms").mkdir(parents=True, exist_ok=True)
    untrained_model = build(args.seed)
    untrained = fabric_arms.eval_loss(untrained_model, fabric_arms.text_data()[1])
    extra = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    ddp_out = out / "arms" / "ddp.json"
    print(f"[litgpt_pretrain] DDP of {args.islands} ranks, {args.steps} steps each", flush=True)
    ddp = fabric_arms.run_process(
        fabric_arms.child_command(MODULE, "ddp", args.seed, args.steps, args.islands, ddp_out, extra), ddp_out)
    print(f"[litgpt_pretrain] {args.islands} Decoupled DiLoCo islands, {args.steps} steps each", flush=True)
    islands = fabric_arms.run_islands(MODULE, build, run_config(), args.seed, args.steps, args.islands, out / "arms", extra)
    summary = summarize(args, untrained, ddp, islands, sum(t.numel() for t in untrained_model.parameters()))
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary, out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
