"""Step time and memory of an FSDP2 island against plain FSDP2, one island of 2 processes.

    python -m benchmarks.fsdp_overhead [--steps 80] [--hidden 256] [--layers 4] [--repeats 2]

The tiny Llama of ``benchmarks.overhead``, sharded per decoder layer and on the root
(``fully_shard`` in ``configure_model``), trained by Lightning's ``ModelParallelStrategy`` (plain
FSDP2) and by ``DecoupledDiLoCoFSDPStrategy`` at the paper's schedule (P = 24, H = 24, tau = 2,
int4 uplink) against a synchronizer in the benchmark's own process (so the island's memory is
the island's, not an embedded synchronizer's), 2 processes on gloo. Each arm runs in fresh
processes and the arms alternate ``--repeats`` times. Figures: the ratio of the medians of the
per-run median step times (warm-up excluded); each rank's peak resident memory (the process's,
so the synchronizer client's libraries count too); and what the island keeps per rank (its base
fragments: this rank's shards) and moves whole (the largest fragment).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_diloco  # noqa: F401
from benchmarks.overhead import LM, RandomTokens, StepTimer
from lightning_diloco import DecoupledDiLoCoFSDPStrategy
from lightning_diloco.core.settings import config_with
from lightning_diloco.launch.supervisor import clean_environment
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from recipes.processes import run_tree


class ShardedLM(LM):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class IslandMemory(pl.Callback):
    """What the island holds per rank, read before the strategy tears the learner down."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        learner = getattr(trainer.strategy, "learner", None)
        if learner is not None:
            layout = learner.layout
            self.figures = {
                "bases_mb": sum(f.base.numel() for f in learner.fragments) * 4 / 2**20,
                "largest_fragment_mb": max(layout.fragment_numel(p) for p in range(layout.num_fragments)) * 4 / 2**20,
                "model_mb": layout.total_numel * 4 / 2**20,
            }


def run_arm(arm: str, args) -> None:
    torch.set_num_threads(1)
    if arm == "diloco":
        strategy = DecoupledDiLoCoFSDPStrategy(sync_every=24, num_fragments=args.num_fragments, overlap_steps=2,
                                               uplink_codec="int4")
    else:
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    timer, memory = StepTimer(min(args.warmup, args.steps - 1), args.steps), IslandMemory()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer, memory])
    data = RandomTokens(args.steps * args.batch * 2, args.seq, args.vocab)
    trainer.fit(ShardedLM(args.hidden, args.layers, args.vocab), DataLoader(data, batch_size=args.batch))
    warm = min(args.warmup, len(timer.times) - 1)
    result = {"rank": trainer.global_rank, "step_s": statistics.median(timer.times[warm:]),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **memory.figures}
    (Path(args.results) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _arm(arm: str, argv: list[str], synchronizer: str) -> list[dict]:
    env = clean_environment({"OMP_NUM_THREADS": "1", **({"DILOCO_SYNCHRONIZER": synchronizer} if arm == "diloco" else {})})
    with tempfile.TemporaryDirectory() as results:
        out = run_tree([sys.executable, "-m", "benchmarks.fsdp_overhead", "--arm", arm, "--results", results, *argv],
                       capture_output=True, text=True, env=env, timeout=1200)
        if out.returncode != 0:
            raise RuntimeError(f"{arm} arm failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        return [json.loads((Path(results) / f"rank{r}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--num-fragments", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the two arms, each in fresh processes")
    parser.add_argument("--arm", choices=["plain", "diloco"], help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)  # where each rank of an arm writes its figures
    args = parser.parse_args(argv)
    if args.arm:
        run_arm(args.arm, args)
        return {}

    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}"
                 for name in ("steps", "warmup", "hidden", "layers", "vocab", "seq", "batch", "num_fragments")]
    runs: dict[str, list[list[dict]]] = {"plain": [], "diloco": []}
    for _ in range(args.repeats):
        for arm in runs:
            # a fresh synchronizer per run: an island joining a finished run would start at its end
            config = config_with(dict(sync_every=24, num_fragments=args.num_fragments, overlap_steps=2, uplink_codec="int4"))
            server = SynchronizerServer(Synchronizer(config), host="127.0.0.1", port=0).start()
            try:
                runs[arm].append(_arm(arm, forwarded, server.address))
            finally:
                server.stop(grace=0)
    step = {arm: statistics.median(r[0]["step_s"] for r in rs) for arm, rs in runs.items()}
    rss = {arm: [max(r[k]["peak_rss_mb"] for r in rs) for k in range(2)] for arm, rs in runs.items()}
    island = runs["diloco"][-1][0]
    result = {"plain_step_s": step["plain"], "diloco_step_s": step["diloco"], "ratio": step["diloco"] / step["plain"],
              "plain_peak_rss_mb": rss["plain"], "diloco_peak_rss_mb": rss["diloco"],
              **{k: island.get(k) for k in ("bases_mb", "largest_fragment_mb", "model_mb")}}
    print(f"FSDP2 island overhead: {island.get('model_mb', 0):.1f} MB (fp32) Llama over 2 processes, batch "
          f"{args.batch}x{args.seq} per rank, {args.steps} steps, {args.repeats} alternations")
    print(f"plain FSDP2 median step     {step['plain'] * 1e3:8.1f} ms   peak RSS per rank {rss['plain']} MB")
    print(f"FSDP2 island median step    {step['diloco'] * 1e3:8.1f} ms   peak RSS per rank {rss['diloco']} MB")
    print(f"step-time ratio island / plain: {result['ratio']:.3f}; the island keeps {island.get('bases_mb', 0):.2f} MB of "
          f"bases per rank, moves at most one whole fragment of {island.get('largest_fragment_mb', 0):.2f} MB")
    return result


if __name__ == "__main__":
    main()
