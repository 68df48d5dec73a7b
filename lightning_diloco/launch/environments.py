"""What the launcher gives each process it starts: the synchronizer's command line and
environment, and an island's environment (the ``DILOCO_*`` variables its training script reads).

Pure functions of the run's options: :class:`~lightning_diloco.launch.run.Run` calls them at each
(re)start, so every restart gets a fresh ``MASTER_PORT``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from lightning_diloco.launch.options import RunOptions
from lightning_diloco.launch.supervisor import clean_environment
from lightning_diloco.launch.workdir import checkpoint_folder, progress_file
from lightning_diloco.learner.arguments import PROGRESS_LINES_ENV
from lightning_diloco.synchronizer.credentials import island_credential


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synchronizer_command(options: RunOptions, workdir: Path, port: int) -> list[str]:
    """The started synchronizer's command line; writes the run settings it reads to ``workdir``."""
    cmd = [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--port", str(port),
           "--checkpoint-dir", str(workdir / "synchronizer"), "--checkpoint-every", str(options.checkpoint_every),
           "--liveness-timeout", str(options.liveness_timeout),
           "--num-islands", str(options.islands)]  # the run's count is the operator's, as the islands are told it
    if options.run_config is not None:
        config = workdir / "run-config.json"
        config.write_text(json.dumps(options.run_config.to_dict(), indent=2))
        cmd += ["--config", str(config)]
    return cmd + options.synchronizer_args  # the caller's own arguments come last: they win


def synchronizer_environment(token: str | None) -> dict[str, str]:
    # the token goes by environment, never on a command line (the process list shows those)
    return clean_environment({"OMP_NUM_THREADS": "1", **({"DILOCO_TOKEN": token} if token else {})})


# Upstream warnings every island prints once each, M times per run, that say nothing about the
# user's code or the run (message prefixes, as -W takes them: no colon or comma in them). A
# PYTHONWARNINGS the user set is kept and goes after these, so it wins.
UPSTREAM_WARNINGS = (
    "ignore:`isinstance(treespec",  # torch's pytree deprecation, raised inside Lightning
    "ignore:The number of training batches",  # Lightning's log_every_n_steps tip
    "ignore:Be aware that when using `ckpt_path`",  # Lightning, on every resumed island
)


def island_warnings(user: str | None) -> str:
    """PYTHONWARNINGS for an island process: :data:`UPSTREAM_WARNINGS`, then the user's own."""
    return ",".join([*UPSTREAM_WARNINGS, *([user] if user else [])])


LINE_EVERY_S = 10.0  # a line per island every 10 s, in its log or behind its [island i] prefix


def island_environment(options: RunOptions, island: int, workdir: Path, synchronizer: str | None) -> dict[str, str]:
    """Island ``island``'s environment (with ``--baseline ddp``: the one DDP job's, ``island`` 0);
    ``synchronizer`` is the address the islands join (None only with ``--baseline ddp``)."""
    ddp = options.baseline == "ddp"
    extra = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "DILOCO_NUM_ISLANDS": str(options.islands),
        "DILOCO_DEVICES": str(options.devices_per_island * (options.islands if ddp else 1)),
        "DILOCO_PROGRESS_FILE": str(progress_file(workdir, island)),
        "DILOCO_CHECKPOINT_DIR": str(checkpoint_folder(workdir, island)),
        "PYTHONWARNINGS": island_warnings(os.environ.get("PYTHONWARNINGS")),
        # its output is a pipe: the progress bar as lines (learner/line_progress.py), as often as the user says
        PROGRESS_LINES_ENV: os.environ.get(PROGRESS_LINES_ENV, f"{LINE_EVERY_S:g}"),
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # Every island process shares this host's cores. Left unset, Lightning gives each
        # process cores // its own world size threads, so M one-process islands ran M times
        # too many OpenMP threads, spinning against each other (measured: 4 islands on 2
        # cores trained 5x slower).
        processes = options.islands * options.devices_per_island
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    if ddp:
        extra["DILOCO_STRATEGY"] = "ddp"
    else:
        if synchronizer is None:
            raise ValueError(f"island {island} of a decoupled DiLoCo run needs the synchronizer's address to join; "
                             "pass --synchronizer HOST:PORT or let the launcher start one")
        extra.update(DILOCO_STRATEGY="decoupled_diloco", DILOCO_ISLAND=str(island), DILOCO_SYNCHRONIZER=synchronizer)
        if options.token:  # each island its own credential: it can act only as itself
            extra["DILOCO_TOKEN"] = island_credential(options.token, island)
    return clean_environment(extra)
