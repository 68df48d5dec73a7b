"""What ``lightning-diloco run`` takes: :class:`RunOptions` for callers in Python, and the same
fields as its command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.token_options import add_token_arguments, resolve_token


@dataclass(kw_only=True)
class RunOptions:
    """What ``lightning-diloco run`` takes, for callers in Python (recipes, benchmarks): each
    field is the flag of the same name (``add_run_arguments``), with the same default."""

    islands: int = 2
    devices_per_island: int = 1
    synchronizer: str | None = None
    """Join this synchronizer (host:port[,...]) instead of starting one."""
    token: str | None = None
    chaos: str | None = None
    chaos_horizon: float = 3600.0
    report: str | None = None
    max_restarts: int = 5
    restart_backoff: float = 1.0
    stagger: float = 0.0
    liveness_timeout: float = 5.0
    checkpoint_every: int = 1
    baseline: str | None = None
    progress_every: float = 0.0
    """Seconds between progress lines, each process's output going to WORKDIR/NAME.log; 0: print all output."""
    workdir: str | None = None
    resume: bool = False
    """Continue the run whose state ``workdir`` holds; without it an earlier run there is moved aside."""
    run_config: RunConfig | None = None
    """The started synchronizer's run settings (passed as ``--config``); None: the defaults."""
    synchronizer_args: list[str] = field(default_factory=list)
    """More arguments for the started synchronizer, e.g. ``["--status-port=8080"]``."""

    def __post_init__(self) -> None:
        if self.islands < 1 or self.devices_per_island < 1:
            raise ValueError(f"--islands={self.islands} and --devices-per-island={self.devices_per_island} must be >= 1")
        if self.baseline not in (None, "ddp"):
            raise ValueError(f"baseline={self.baseline!r}: the only baseline is 'ddp'")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("token", "run_config")]
        return cls(**{name: getattr(args, name) for name in names}, token=resolve_token(args))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``lightning-diloco run``; ``RunOptions.from_args`` reads them."""
    d = RunOptions()
    parser.add_argument("--islands", type=int, default=d.islands, help="M, learner islands (default %(default)s)")
    parser.add_argument("--devices-per-island", type=int, default=d.devices_per_island, help="DDP processes per island (DILOCO_DEVICES)")
    parser.add_argument("--synchronizer", help="use this synchronizer (host:port[,...]) instead of starting one")
    add_token_arguments(parser, "run's shared secret")
    parser.add_argument("--chaos", help="fault schedule, e.g. 'kill 1 at 20s; pause 2 at 30s for 5s' or @FILE")
    parser.add_argument("--chaos-horizon", type=float, default=d.chaos_horizon, help="seconds over which random faults are drawn (default %(default)s)")
    parser.add_argument("--report", help="write the run report as JSON here")
    parser.add_argument("--max-restarts", type=int, default=d.max_restarts, help="restarts per island before the run fails (default %(default)s)")
    parser.add_argument("--restart-backoff", type=float, default=d.restart_backoff, help="first restart delay after a crash, doubling (default %(default)s)")
    parser.add_argument("--stagger", type=float, default=d.stagger,
                        help="start island i i x this many seconds after island 0 (islands out of phase, as on a real cluster)")
    parser.add_argument("--liveness-timeout", type=float, default=d.liveness_timeout, help="synchronizer: seconds of silence before an island is not waited for (default %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help="synchronizer: outer steps between checkpoints; a killed synchronizer loses at most this many - 1 "
                        "(default %(default)s)")
    parser.add_argument("--progress-every", type=float, default=d.progress_every, metavar="S",
                        help="print a progress line (steps, loss, outer steps) every S seconds and send each process's "
                        "output to WORKDIR/NAME.log, showing only warnings and errors; 0 (default): print all output")
    parser.add_argument("--baseline", choices=["ddp"], help="run COMMAND as one DDP job with checkpoint-restart instead")
    parser.add_argument("--workdir", help="progress files, checkpoints and synchronizer state (default: a temporary folder, "
                        "removed when the run ends); an earlier run found there is moved aside to WORKDIR.prev-<time>")
    parser.add_argument("--resume", action="store_true", help="continue the run in --workdir (its synchronizer checkpoint, "
                        "the islands' checkpoints) instead of moving it aside")
    parser.add_argument("--sync", dest="synchronizer_args", action="append", default=[], metavar="ARG",
                        help="pass ARG to the synchronizer, e.g. --sync=--min-quorum=2 or --sync=--config=run.json (repeatable)")
