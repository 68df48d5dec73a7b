"""A recipe's run on a virtual clock (lightning_diloco/simulate): the package's synchronizer and
island learners in one process, each island a copy of the recipe's model with its own AdamW,
scheduler and DDP rank shard, stepping when the event queue says. One seed and one plan reproduce
a run exactly; timing is a parameter, not noise.

    python -m recipes.simulate --preset cpu-tiny --seed 0                       # the main job's defaults
    python -m recipes.simulate --preset cpu-tiny --min-quorum 4 --overlap-steps 0   # synchronous DiLoCo
    python -m recipes.simulate --preset cpu-tiny --starts 0,3,6,9 --speeds 1,1,1,1.5
    python -m recipes.simulate --preset cpu-tiny --setup 0                      # every island steps at once after its join
    python -m recipes.simulate --preset cpu-tiny --fail 1@20+5                  # island 1 dies at 20 s, back 5 s later
    python -m recipes.simulate --preset cpu-tiny --ddp                          # DDP over the same shards, same steps

Every run setting of the real system is a flag (``--sync-every``, ``--apply``, ``--outer-lr``, ...), and
the recipe's ``--stagger`` and ``--slow-island``/``--slowdown`` mean what they mean there.
Prints one JSON line: the final eval loss of the global model and the rounds' health.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_diloco.core.settings import config_with, given_settings  # noqa: E402
from recipes.common import Recipe, build_parser, evaluate, evenly_spaced, resolve  # noqa: E402

RECIPES = {"text_lm": "recipes.text_lm", "vision": "recipes.vision"}
SETUP_SPREAD = 0.7  # seconds between the real main job's islands' first steps, at most (real_setups)


def per_island(text: str | None, islands: int, name: str) -> list[float]:
    """``"a,b,..."`` (one value per island) or one value for all; None: zeros."""
    if not text:
        return [0.0] * islands
    values = [float(v) for v in text.split(",")]
    if len(values) == 1:
        values *= islands
    if len(values) != islands:
        raise SystemExit(f"--{name}={text}: give one value, or one per island ({islands})")
    return values


def real_setups(islands: int, seed: int) -> list[float]:
    """Each island's seconds from its join to its first step, spread as the real main job's: its
    four islands joined within 0.7 s of each other and took their first steps within one 0.7 s
    poll of the launcher (runs/main of a fresh clone, 2026-11-27). Which island sets up first
    differs from run to run, so the draws follow the run's seed (the jitter's follow the island)."""
    return [random.Random(f"setup-{seed}-{i}").uniform(0.0, SETUP_SPREAD) for i in range(islands)]


def failures(text: str | None, islands: int) -> dict[int, list[tuple[float, float]]]:
    """``"I@T+D,..."``: island I dies T seconds into the run and is back D seconds later."""
    out: dict[int, list[tuple[float, float]]] = {}
    for item in (text or "").split(","):
        if not item:
            continue
        try:
            island, rest = item.split("@")
            at, down = rest.split("+")
            i = int(island)
        except ValueError:
            raise SystemExit(f"--fail={text}: each failure is ISLAND@SECONDS+DOWNTIME, e.g. 1@20+5") from None
        if not 0 <= i < islands:
            raise SystemExit(f"--fail={text}: island {i} is not one of 0..{islands - 1}")
        out.setdefault(i, []).append((float(at), float(down)))
    return out


class RecipeLoop:
    """One island's (or, with ``ranks``, the DDP job's) inner loop over the recipe's module: its
    optimizer and scheduler, and the DDP rank shards of the training set (batches of every rank
    concatenated: DDP's averaged gradient)."""

    def __init__(self, recipe: Recipe, args: argparse.Namespace, train_set, ranks: list[int]) -> None:
        import torch
        from torch.utils.data import DataLoader, DistributedSampler

        self.module = recipe.build_module(args)
        self.model = self.module
        opt = self.module.configure_optimizers()
        self.optimizer, self.scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
        self.samplers = [DistributedSampler(train_set, num_replicas=args.islands, rank=r, shuffle=True, seed=args.seed,
                                            drop_last=True) for r in ranks]
        self.loaders = [DataLoader(train_set, batch_size=args.batch, sampler=s, drop_last=True) for s in self.samplers]
        self.epoch, self.iters = 0, [iter(loader) for loader in self.loaders]
        self.tokens = recipe.tokens_per_sample(args) * args.batch * len(ranks)
        self.index = 0
        self.torch = torch

    def _batch(self):
        batches = []
        for k in range(len(self.loaders)):
            try:
                batches.append(next(self.iters[k]))
            except StopIteration:
                self.epoch += 1
                for sampler in self.samplers:
                    sampler.set_epoch(self.epoch)
                self.iters = [iter(loader) for loader in self.loaders]
                return self._batch()
        if isinstance(batches[0], dict):
            return {key: self.torch.cat([b[key] for b in batches]) for key in batches[0]}
        return [self.torch.cat([b[i] for b in batches]) for i in range(len(batches[0]))]

    def step(self) -> float:
        loss = self.module.training_step(self._batch(), self.index)
        self.index += 1
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return float(self.tokens)


def main(argv: list[str] | None = None) -> int:
    import importlib

    import torch

    from lightning_diloco.simulate.run import IslandPlan, Simulation

    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_name = "text_lm"
    if "--recipe" in argv:
        recipe_name = argv[argv.index("--recipe") + 1]
        del argv[argv.index("--recipe"):argv.index("--recipe") + 2]
    if recipe_name not in RECIPES:
        raise SystemExit(f"--recipe={recipe_name}: one of {', '.join(RECIPES)}")
    recipe: Recipe = importlib.import_module(RECIPES[recipe_name]).RECIPE
    parser = build_parser(recipe, __doc__)
    g = parser.add_argument_group("the virtual clock (one value for every island, or one per island)")
    g.add_argument("--step-time", default="0.09", help="seconds per inner step (the main job's, 800 in about 75 s) (default %(default)s)")
    g.add_argument("--speeds", help="step-time factors, e.g. 1,1,1,1.5")
    g.add_argument("--starts", help="seconds after the start at which each island joins")
    g.add_argument("--setup", help="seconds from each island's join to its first step (default: drawn per island and seed "
                                   f"from 0-{SETUP_SPREAD} s, as the real main job's first steps spread; 0: all at once)")
    g.add_argument("--uplink-latency", help="seconds a push takes to arrive")
    g.add_argument("--downlink-latency", help="seconds an ack, request or version takes to arrive")
    g.add_argument("--jitter", help="relative spread of each step's time (seeded draws), e.g. 0.2")
    g.add_argument("--fail", help="ISLAND@SECONDS+DOWNTIME,...: island dies, comes back (fresh optimizer, data from the start)")
    g.add_argument("--sync-time", type=float, default=0.005, help="seconds a round's close takes (default %(default)s)")
    g.add_argument("--ddp", action="store_true", help="DDP over the same rank shards instead (one model, every rank's batch)")
    args = resolve(recipe, parser.parse_args(argv))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    warnings.filterwarnings("ignore", message=".*self.log.*")  # the module logs for a Trainer; none here
    train_set, val_set = recipe.datasets(args)
    from torch.utils.data import DataLoader

    val = DataLoader(evenly_spaced(val_set, args.final_eval_batches * args.batch), batch_size=args.batch)
    M, started = args.islands, time.perf_counter()
    if args.ddp:
        loop = RecipeLoop(recipe, args, train_set, list(range(M)))
        for _ in range(args.steps):
            loop.step()
        model, health = loop.module, {}
    else:
        step_time = per_island(args.step_time, M, "step-time")
        speeds = per_island(args.speeds, M, "speeds") if args.speeds else [1.0] * M
        if not args.speeds and 0 <= args.slow_island < M:  # the recipe's own straggler flags mean the same here
            speeds[args.slow_island] = args.slowdown
        starts = per_island(args.starts, M, "starts") if args.starts else [i * args.stagger for i in range(M)]
        setups = per_island(args.setup, M, "setup") if args.setup else real_setups(M, args.seed)
        up = per_island(args.uplink_latency, M, "uplink-latency")
        jitter = per_island(args.jitter, M, "jitter")
        down, fails = per_island(args.downlink_latency, M, "downlink-latency"), failures(args.fail, M)
        plans = [IslandPlan(step_time=step_time[i] * speeds[i], start=starts[i], setup=setups[i], uplink_latency=up[i],
                            downlink_latency=down[i], failures=tuple(fails.get(i, ())), jitter=jitter[i]) for i in range(M)]
        sim = Simulation(config_with(given_settings(args)), lambda i: RecipeLoop(recipe, args, train_set, [i]), plans,
                         args.steps, sync_time=args.sync_time)
        result = sim.run()
        model = result.global_model
        health = {"outer_steps": result.outer_steps, "contributions_per_step": round(result.per_outer_step, 3),
                  "late_share": round(result.late_share, 3), "superseded": result.superseded,
                  "clipped_share": round(result.clipped / max(1, result.contributions), 3),
                  "skipped": result.skipped, "restarts": result.restarts,
                  "virtual_s": round(result.virtual_s, 2), "setups": [round(t, 3) for t in setups]}
    final = evaluate(model, val, torch.device("cpu"))
    print(json.dumps({"recipe": recipe.name, "preset": args.preset, "seed": args.seed, "ddp": args.ddp,
                      "settings": {k: v for k, v in given_settings(args).items()}, "final": final, **health,
                      "wall_s": round(time.perf_counter() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
