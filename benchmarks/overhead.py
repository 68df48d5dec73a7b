"""Step-time overhead of decoupled_diloco against plain Lightning: a one-process island and a
2-process DDP island.

    python -m benchmarks.overhead [--processes 1 2] [--steps 150] [--hidden 256] [--layers 4] [--repeats 4]
                                  [--torch-threads N]

The same tiny Llama on the same random tokens, trained by plain Lightning and by
``DecoupledDiLoCoStrategy`` at the paper's schedule (P = 24, H = 24, tau = 2, int4 uplink)
against its embedded synchronizer (in the island leader's process, as
``Trainer(strategy="decoupled_diloco")`` runs a one-island job). With one process the plain arm
is Lightning's default single-device strategy (what a user switches from; a one-process island
takes the same path); with 2 processes it is Lightning's DDP (gloo, one torch thread per
process) against a 2-process island, DDP inside, whose leader also plans, broadcasts its plan
and streams to the synchronizer. Each arm runs in fresh processes and the arms alternate
``--repeats`` times: on a shared 2-core VM, identical runs in one process drift by +-20%
(allocator and scheduler state), which would swamp the figure. The figure per process count is
the ratio of the medians of the per-run median step times of rank 0 (warm-up steps excluded).
``--torch-threads 1`` runs both one-process arms on one torch thread, leaving this VM's second
core beside the training as any GPU host has cores beside its training loop: the island's
background threads then cost the training loop only what they take from it directly (the GIL,
memory bandwidth), not a training thread's core.

Beside the wall clock, each arm reports the CPU its process's threads spent per step after the
warm-up (rank 0's process; Linux's per-thread ``schedstat``), by thread: the training loop (the
main thread), Python threads by name (``diloco-closer-N``...), native threads by their OS name
(the OpenMP team, gRPC's core). CPU time moves far less than step times with what else runs on a
shared machine, so it shows what a change moves where the step-time ratio cannot. Each thread's
minor page faults per step are printed beside it: the first touches of memory the allocator took
fresh from the kernel, a cost that shows in CPU time but not in any Python profile.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_diloco  # noqa: F401
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.launch.supervisor import clean_environment
from lightning_diloco.learner.collective import leave_process_group
from recipes.processes import run_tree


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


def thread_usage() -> tuple[Counter[str], Counter[str]]:
    """CPU seconds and minor page faults so far of this process's threads, grouped by what they
    are (numbers in names dropped: ``diloco-closer-N``); empty where /proc has no per-thread
    ``schedstat``. A minor fault is a first touch of a page the allocator got fresh from the
    kernel: on this VM about 5 us each, so a thread that allocates a fresh 1 MB tensor per step
    spends about a millisecond in the kernel for it."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    cpu: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    for task in Path("/proc/self/task").iterdir():
        try:
            seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
            comm = (task / "comm").read_text().strip()
            minor = int((task / "stat").read_text().rsplit(")", 1)[1].split()[7])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        tid = int(task.name)
        if tid == main:
            group = "training loop"
        elif tid in names:
            group = re.sub(r"\d+", "N", names[tid])
        else:
            group = f"native {re.sub(r'[0-9_-]+$', '', comm)}"
        cpu[group] += seconds
        faults[group] += minor
    return cpu, faults


class StepTimer(pl.Callback):
    """Each step's wall time, and the threads' CPU time from the end of the warm-up to the last step."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.times: list[float] = []
        self._start = 0.0
        self._usage_start: tuple[Counter[str], Counter[str]] | None = None
        self.cpu_ms_per_step: dict[str, float] = {}
        self.faults_per_step: dict[str, float] = {}

    def on_train_batch_start(self, *args) -> None:
        if len(self.times) == self.warmup:
            self._usage_start = thread_usage()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)
        if len(self.times) == self.steps and self._usage_start is not None:
            measured = self.steps - self.warmup
            spent, faults = thread_usage()
            spent.subtract(self._usage_start[0])
            faults.subtract(self._usage_start[1])
            self.cpu_ms_per_step = {group: round(s * 1e3 / measured, 3) for group, s in sorted(spent.items())}
            self.faults_per_step = {group: round(n / measured, 1) for group, n in sorted(faults.items())}


def run_arm(strategy, args, processes: int = 1) -> tuple[float, dict, int]:
    """Rank 0's median step time, the island's final metrics with the threads' CPU per step, and
    this process's rank."""
    timer = StepTimer(min(args.warmup, args.steps - 1), args.steps)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=processes, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    data = RandomTokens(args.steps * args.batch * processes, args.seq, args.vocab)
    trainer.fit(LM(args.hidden, args.layers, args.vocab), DataLoader(data, batch_size=args.batch))
    warm = min(args.warmup, len(timer.times) - 1)
    metrics = {**getattr(trainer.strategy, "final_metrics", {}), "cpu_ms_per_step": timer.cpu_ms_per_step,
               "faults_per_step": timer.faults_per_step}
    return statistics.median(timer.times[warm:]), metrics, trainer.global_rank


def _arm_in_subprocess(arm: str, processes: int, argv: list[str]) -> dict:
    # a clean environment: a caller that ran DDP itself has MASTER_PORT, LOCAL_RANK... set
    with tempfile.TemporaryDirectory() as results:
        out = run_tree([sys.executable, "-m", "benchmarks.overhead", "--arm", arm, "--processes", str(processes),
                        "--results", results, *argv], capture_output=True, text=True, env=clean_environment({}),
                       timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"{arm} arm ({processes} process(es)) failed ({out.returncode}):\n{out.stdout[-2000:]}\n"
                               f"{out.stderr[-3000:]}")
        return json.loads((Path(results) / "rank0.json").read_text())


def _median_by_group(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each thread group's median CPU per step over runs (0 in a run where it did not run)."""
    groups = sorted({group for run in runs for group in run})
    return {group: round(statistics.median(run.get(group, 0.0) for run in runs), 3) for group in groups}


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
    parser.add_argument("--repeats", type=int, default=4, help="alternations of the two arms, each in fresh processes")
    parser.add_argument("--processes", type=int, nargs="+", choices=[1, 2], default=[1, 2],
                        help="island sizes to measure: 1 (one process) and/or 2 (DDP inside); default both")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads of a one-process arm (default: torch's own, one per core); 1 leaves a core "
                             "beside the training, as a GPU host has")
    parser.add_argument("--json", action="store_true", help="also print the results, every run's figures included, as JSON")
    parser.add_argument("--arm", choices=["plain", "diloco"], help=argparse.SUPPRESS)  # one run, JSON out
    parser.add_argument("--results", help=argparse.SUPPRESS)  # where rank 0 of an arm writes its figures
    args = parser.parse_args(argv)

    if args.arm:
        processes = args.processes[0]
        if args.torch_threads and processes == 1:
            torch.set_num_threads(args.torch_threads)
        strategy = "ddp" if processes > 1 else "auto"
        if args.arm == "diloco":
            strategy = DecoupledDiLoCoStrategy(sync_every=24, num_fragments=args.num_fragments, overlap_steps=2, uplink_codec="int4")
        step, metrics, rank = run_arm(strategy, args, processes)
        leave_process_group()  # the ranks of a 2-process arm exit together
        if rank == 0:
            (Path(args.results) / "rank0.json").write_text(json.dumps({"step_s": step, "threads": torch.get_num_threads(),
                                                                        **metrics}))
        return {}

    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}"
                 for name in ("steps", "warmup", "hidden", "layers", "vocab", "seq", "batch", "num_fragments", "torch_threads")]
    params = sum(p.numel() for p in LM(args.hidden, args.layers, args.vocab).parameters())
    print(f"overhead benchmark: {params / 1e6:.1f}M-parameter Llama, batch {args.batch}x{args.seq} per process, "
          f"{args.steps} steps, {args.repeats} alternations of fresh processes")
    results = {}
    for processes in args.processes:
        plain, diloco, metrics, threads = [], [], {}, 0
        plain_cpu, diloco_cpu, hook_ms, plain_faults, diloco_faults = [], [], [], [], []
        for _ in range(args.repeats):
            baseline = _arm_in_subprocess("plain", processes, forwarded)
            plain.append(baseline["step_s"])
            plain_cpu.append(baseline["cpu_ms_per_step"])
            plain_faults.append(baseline["faults_per_step"])
            metrics = _arm_in_subprocess("diloco", processes, forwarded)
            diloco.append(metrics["step_s"])
            diloco_cpu.append(metrics["cpu_ms_per_step"])
            diloco_faults.append(metrics["faults_per_step"])
            hook_ms.append(metrics.get("diloco/blocked_s", 0.0) * 1e3 / args.steps)
            threads = metrics["threads"]
        result = {
            "plain_step_s": statistics.median(plain),
            "diloco_step_s": statistics.median(diloco),
            "plain_runs_s": plain,
            "diloco_runs_s": diloco,
            "torch_threads": threads,
            "syncs_applied": metrics.get("diloco/syncs_applied", 0.0),
            "blocked_s": metrics.get("diloco/blocked_s", 0.0),
            "hook_ms_per_step_runs": hook_ms,
            "plain_cpu_ms_per_step": _median_by_group(plain_cpu),
            "diloco_cpu_ms_per_step": _median_by_group(diloco_cpu),
            "plain_faults_per_step": _median_by_group(plain_faults),
            "diloco_faults_per_step": _median_by_group(diloco_faults),
            "plain_cpu_runs": plain_cpu,
            "diloco_cpu_runs": diloco_cpu,
        }
        result["ratio"] = result["diloco_step_s"] / result["plain_step_s"]
        results[processes] = result
        kind = "one-process island vs single-device" if processes == 1 else f"{processes}-process island vs DDP"
        print(f"{kind} ({threads} torch thread(s) per process):")
        print(f"  plain Lightning median step  {result['plain_step_s'] * 1e3:8.2f} ms  runs: "
              + " ".join(f"{t * 1e3:.0f}" for t in plain))
        print(f"  decoupled_diloco median step {result['diloco_step_s'] * 1e3:8.2f} ms  runs: "
              + " ".join(f"{t * 1e3:.0f}" for t in diloco)
              + f"  ({result['syncs_applied']:.0f} syncs applied, {result['blocked_s']:.3f} s in the sync hook)")
        print(f"  step-time ratio diloco / plain ({processes} process(es)): {result['ratio']:.3f}")
        print("  sync hook ms per step, runs: " + " ".join(f"{h:.2f}" for h in hook_ms))
        for arm in ("plain", "diloco"):
            cpu = result[f"{arm}_cpu_ms_per_step"]
            beside = {group: ms for group, ms in cpu.items() if group != "training loop"}
            print(f"  CPU ms per step, {arm} (medians of runs): training loop {cpu.get('training loop', 0.0):.1f}, "
                  f"beside it {sum(beside.values()):.1f}: "
                  + ", ".join(f"{group} {ms:.2f}" for group, ms in sorted(beside.items(), key=lambda kv: -kv[1]) if ms >= 0.05))
            faults = result[f"{arm}_faults_per_step"]
            print(f"  minor page faults per step, {arm} (medians of runs): total {sum(faults.values()):.0f}: "
                  + ", ".join(f"{group} {n:.0f}" for group, n in sorted(faults.items(), key=lambda kv: -kv[1]) if n >= 1))
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
