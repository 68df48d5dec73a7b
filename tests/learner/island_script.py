"""One learner island as a user would launch it: `python island_script.py OUT [--devices N] [--fsdp]`
(or one node of a multi-node island: `torchrun --nnodes 2 ... island_script.py OUT --num-nodes 2`).

Reads DILOCO_* from the environment, trains TinyRegressor (sharded with FSDP2 by
``--fsdp``; compiled or checkpointed by ``--wrapping``, in bf16 by ``--precision``), and writes
each rank's final weights (whole) and the island's metrics to OUT/rank{R}.pt.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

torch.set_num_threads(1)

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_diloco  # noqa: E402,F401
from lightning_diloco import DecoupledDiLoCoFSDPStrategy, DecoupledDiLoCoStrategy  # noqa: E402
from lightning_diloco.learner.collective import leave_process_group  # noqa: E402
from tests.helpers import exit_now  # noqa: E402
from tests.learner.models import (  # noqa: E402
    WRAPPINGS,
    ShardedTinyRegressor,
    loader,
    regression_data,
    trainer,
    wrapped_regressor,
)


class WaitForAllIslands(Callback):
    """Start the first step only when every island has joined, and give steps a real duration:
    startup skew between processes is seconds, a tiny step is a millisecond."""

    def __init__(self, num_islands: int, step_seconds: float) -> None:
        self.num_islands, self.step_seconds = num_islands, step_seconds
        self.waited = False

    def on_train_batch_start(self, trainer, *args):
        # not on_train_start: an FSDP2 island joins in the strategy's on_train_start, after the callbacks'
        if self.waited:
            return
        self.waited = True
        link = trainer.strategy.learner.link
        deadline = time.monotonic() + 120
        while link is not None and len(link.status().live_islands) < self.num_islands:
            assert time.monotonic() < deadline, "the other islands never joined"
            time.sleep(0.1)

    def on_train_batch_end(self, *args):
        time.sleep(self.step_seconds)


class PauseAt(Callback):
    """Test control (``--pause-at N,M --control DIR``): at the first step from each of these on
    which rank 0's learner holds every version it was sent (no send in flight, none waiting in its
    inbox), rank 0 writes its versions to DIR/paused-N.json and waits for DIR/resume-N (the other
    ranks wait in the next step's collectives), so a test can act on a synchronizer while the
    island holds exactly what it was sent."""

    def __init__(self, steps: list[int], control: Path) -> None:
        self.steps, self.control = sorted(steps), control

    def on_train_batch_end(self, trainer, *args):
        learner = trainer.strategy.learner
        if not self.steps or learner.step < self.steps[0] or learner.inbox is None:  # only the leader has an inbox
            return
        with learner.inbox.cond:
            holds_all = not learner.in_flight and not learner.inbox.fresh and min(learner.versions) >= 0
        if not holds_all:
            return
        n = self.steps.pop(0)
        (self.control / f"paused-{n}.json").write_text(json.dumps({"step": learner.step, "versions": learner.versions}))
        deadline = time.monotonic() + 180
        while not (self.control / f"resume-{n}").exists():
            assert time.monotonic() < deadline, f"no {self.control / f'resume-{n}'} within 180 s"
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes of the island (started by torchrun or SLURM)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (decoupled_diloco_fsdp)")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--overlap", type=int, default=1)
    parser.add_argument("--checkpoint-dir", help="save last.ckpt there at the end of every epoch")
    parser.add_argument("--resume", help="a checkpoint to resume from")
    parser.add_argument("--full-checkpoint", action="store_true", help="FSDP2: one file, not a distributed checkpoint")
    parser.add_argument("--wrapping", choices=WRAPPINGS, default="plain", help="the model as users write it (models.py)")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. bf16-true or bf16-mixed")
    parser.add_argument("--no-wait", action="store_true", help="start training at once, whoever else has joined")
    parser.add_argument("--pause-at", default="", help="steps to pause at (PauseAt), comma-separated; with --control")
    parser.add_argument("--control", help="the directory of PauseAt's files")
    parser.add_argument("--setting", action="append", default=[], help="NAME=VALUE: a run setting over the script's own")
    args = parser.parse_args()
    settings = dict(sync_every=4, num_fragments=2, overlap_steps=args.overlap, uplink_codec="fp32", downlink_codec="fp32")
    for setting in args.setting:
        name, _, value = setting.partition("=")
        settings[name] = json.loads(value) if value[:1].isdigit() else value
    if args.fsdp:
        strategy = DecoupledDiLoCoFSDPStrategy(save_distributed_checkpoint=not args.full_checkpoint, **settings)
    else:
        strategy = DecoupledDiLoCoStrategy(**settings)
    seed = args.seed + strategy.island  # joining aligns them
    model = ShardedTinyRegressor(seed=seed) if args.fsdp else wrapped_regressor(args.wrapping, seed=seed)
    callbacks = [WaitForAllIslands(0 if args.no_wait else strategy.num_islands, args.step_seconds)]
    if args.pause_at:
        callbacks.append(PauseAt([int(n) for n in args.pause_at.split(",")], Path(args.control)))
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0))
    island = trainer(strategy, devices=args.devices, num_nodes=args.num_nodes, max_epochs=args.epochs,
                     max_steps=args.max_steps, callbacks=callbacks, enable_checkpointing=bool(args.checkpoint_dir),
                     precision=args.precision)
    island.fit(model, loader(regression_data(n=512)), ckpt_path=args.resume)
    rank = island.global_rank  # LOCAL_RANK is 0 on every node of a multi-node island
    Path(args.out).mkdir(parents=True, exist_ok=True)
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # whole, sharded or not
    torch.save({"weights": [w.detach() for w in weights], "metrics": strategy.final_metrics,
                "steps": len(model.losses), "losses": model.losses}, Path(args.out) / f"rank{rank}.pt")
    leave_process_group()


if __name__ == "__main__":
    main()
    exit_now()
