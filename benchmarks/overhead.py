"""Step-time overhead of decoupled_diloco against plain Lightning, one island, one process.

    python -m benchmarks.overhead [--steps 150] [--hidden 256] [--layers 4] [--repeats 2]

The same tiny Llama on the same random tokens, trained with Lightning's default single-device
strategy (what a user switches from; a one-process island takes the same path) and with ``DecoupledDiLoCoStrategy`` at the paper's schedule (P = 24, H = 24,
tau = 2, int4 uplink) against its embedded synchronizer. Each arm runs in a fresh process and
the arms alternate ``--repeats`` times: on a shared 2-core VM, identical runs in one process
drift by +-20% (allocator and scheduler state), which would swamp the figure. The figure is the
ratio of the medians of the per-run median step times (warm-up steps excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_diloco  # noqa: F401
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.launch.supervisor import clean_environment


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i]}


class LM(pl.LightningModule):
    def __init__(self, hidden: int, layers: int, vocab: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128), max_position_embeddings=256,
        ))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


def run_arm(strategy, args) -> tuple[float, dict]:
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    data = RandomTokens(args.steps * args.batch, args.seq, args.vocab)
    trainer.fit(LM(args.hidden, args.layers, args.vocab), DataLoader(data, batch_size=args.batch))
    warm = min(args.warmup, len(timer.times) - 1)
    metrics = getattr(trainer.strategy, "final_metrics", {})
    return statistics.median(timer.times[warm:]), metrics


def _arm_in_subprocess(arm: str, argv: list[str]) -> dict:
    # a clean environment: a caller that ran DDP itself has MASTER_PORT, LOCAL_RANK... set
    out = subprocess.run([sys.executable, "-m", "benchmarks.overhead", "--arm", arm, *argv],
                         capture_output=True, text=True, env=clean_environment({}))
    if out.returncode != 0:
        raise RuntimeError(f"{arm} arm failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--num-fragments", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=4, help="alternations of the two arms, each a fresh process")
    parser.add_argument("--arm", choices=["plain", "diloco"], help=argparse.SUPPRESS)  # one run, JSON out
    args = parser.parse_args(argv)

    if args.arm:
        strategy = "auto"
        if args.arm == "diloco":
            strategy = DecoupledDiLoCoStrategy(sync_every=24, num_fragments=args.num_fragments, overlap_steps=2, uplink_codec="int4")
        step, metrics = run_arm(strategy, args)
        print(json.dumps({"step_s": step, **metrics}))
        return {}

    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}"
                 for name in ("steps", "warmup", "hidden", "layers", "vocab", "seq", "batch", "num_fragments")]
    plain, diloco, metrics = [], [], {}
    for _ in range(args.repeats):
        plain.append(_arm_in_subprocess("plain", forwarded)["step_s"])
        metrics = _arm_in_subprocess("diloco", forwarded)
        diloco.append(metrics["step_s"])
    result = {
        "plain_step_s": statistics.median(plain),
        "diloco_step_s": statistics.median(diloco),
        "plain_runs_s": plain,
        "diloco_runs_s": diloco,
        "syncs_applied": metrics.get("diloco/syncs_applied", 0.0),
        "blocked_s": metrics.get("diloco/blocked_s", 0.0),
    }
    result["ratio"] = result["diloco_step_s"] / result["plain_step_s"]
    params = sum(p.numel() for p in LM(args.hidden, args.layers, args.vocab).parameters())
    print(f"overhead benchmark: {params / 1e6:.1f}M-parameter Llama, batch {args.batch}x{args.seq}, {args.steps} steps, "
          f"{args.repeats} alternations of fresh processes, {torch.get_num_threads()} threads")
    print(f"plain Lightning median step  {result['plain_step_s'] * 1e3:8.2f} ms  runs: "
          + " ".join(f"{t * 1e3:.0f}" for t in plain))
    print(f"decoupled_diloco median step {result['diloco_step_s'] * 1e3:8.2f} ms  runs: "
          + " ".join(f"{t * 1e3:.0f}" for t in diloco)
          + f"  ({result['syncs_applied']:.0f} syncs applied, {result['blocked_s']:.3f} s in the sync hook)")
    print(f"step-time ratio diloco / plain: {result['ratio']:.3f}")
    return result


if __name__ == "__main__":
    main()
