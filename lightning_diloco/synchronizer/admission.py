"""Admission of the numbers a client sends: each is checked against the run before it can reach
state that later replies, Status or a checkpoint carry.

Why it matters: a push naming round 2**61 used to become the fragment's next round, so
the run's step (round x H) no longer fit the int64 of every later Join, Heartbeat and Status reply,
and the checkpoint carried it into every restart. The rule: a number that sizes, orders or places
anything is bounded by what the run itself makes plausible, not only by its sign.

- Pushes (their round, counters, sequence numbers and every other rule a push is refused by):
  push_admission.py.
- First contact: the first layout can be pinned by the operator (``--layout-hash``) instead of
  adopted from whoever joins first, and a seed (version 0, the first offer wins) must look like a
  model's weights: finite (codecs.py) and below ``MAX_SEED_ABS`` in magnitude (a first seed of
  3e38 became the global model).
- The island count is the operator's (``--num-islands``) or, without it, the one a quorum of
  the run's islands was started with (:func:`count_agreed`), never one island's: the first
  island to say a count used to fix it for the run and its checkpoint (island 3 joining first
  with 10000 got islands 0-2, started with 4, refused; island 0 saying 1 locked out 1-3).
- The run's settings: a first island's model with fewer tensors than fragments asked for sets
  the fragment count (tensors are never split: :func:`fitted_to_model`), and a resumed run keeps
  the settings its checkpoint holds (:func:`resumed_settings`).
- Schedule steps and step times: membership.py (a robust clock and a rate bound); wait times:
  server.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import MAX_TENSORS
from lightning_diloco.core.settings import run_settings, value_of
from lightning_diloco.core.state import SynchronizerState
from lightning_diloco.synchronizer.membership import MAX_ISLANDS, IslandRunning

log = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1 << 20  # processes per island: past this it is not a world size
MAX_SEED_ABS = 1e6  # no model starts with a weight this large; a seed beyond it is not one


def join_problem(island: int, world_size: int, num_islands: int = 0) -> str | None:
    if island < 0 or not 1 <= world_size <= MAX_WORLD_SIZE:
        return f"island={island} world_size={world_size}: need island >= 0 and 1 <= world_size <= {MAX_WORLD_SIZE}"
    if num_islands and not island < num_islands <= MAX_ISLANDS:  # else the run's count would be one no island has
        return (f"island={island} num_islands={num_islands}: need island < num_islands <= {MAX_ISLANDS} "
                "(num_islands 0: not said)")
    return None


def num_islands_problem(island: int, offered: int, run: int) -> str | None:
    """Whether a joiner started with ``offered`` islands fits a run of ``run`` (0 on either side:
    not known; an older client sends none). Islands started with 2 and 3 were both accepted, and
    each took 1/num_islands of the data by its own count: their data shards overlapped."""
    if offered and run and offered != run:
        return (f"island {island} was started with num_islands={offered}, but the run has num_islands={run} (the count "
                f"a quorum of its islands was started with, or the synchronizer's --num-islands); start every island of a run with the same num_islands "
                f"(DILOCO_NUM_ISLANDS), or start a new run (a new synchronizer) for {offered} islands")
    if run and island >= run:
        return (f"island {island} is not one of the run's num_islands={run} islands (0..{run - 1}); give it an index "
                f"below {run} (DILOCO_ISLAND)")
    return None


def count_agreed(stated: Mapping[int, int], count: int) -> bool:
    """Whether a quorum of the run's islands says ``count``: of the islands ``stated`` holds the
    count of (island -> the num_islands it was started with), more than half of the ``count``
    islands 0..count-1, and at least two, were started with it. One island, or a minority, never
    fixes the count (so a one-island run never does: it has no one to overlap with); once fixed,
    an island started with another count is refused, so no two counts can both be the run's."""
    votes = sum(1 for island, said in stated.items() if said == count and island < count)
    return votes >= max(2, count // 2 + 1)


def seed_problem(fragment: int, value: torch.Tensor) -> str | None:
    largest = float(value.abs().max()) if value.numel() else 0.0
    if largest > MAX_SEED_ABS:
        return (f"seed of fragment {fragment} holds a value of magnitude {largest:.3g}; a model's weights are below "
                f"{MAX_SEED_ABS:g}: seed the fragment from the model's initial weights")
    return None


def tensor_count_problem(offered: int, run_tensors: int | None) -> str | None:
    """Whether a join's tensor count can be the run's, before any of its tensors is read: once
    the run's layout is adopted it must be that layout's count, before that at most MAX_TENSORS.
    (Reading a join of 250,000 tensors took 2.2 s of the synchronizer's interpreter; four clients
    joining so in a loop slowed the honest islands' rounds 180x.)"""
    if run_tensors is not None and offered != run_tensors:
        return f"the model has {offered} trainable tensors, the run's has {run_tensors}; every island must train the same model"
    if offered > MAX_TENSORS:
        return f"the model has {offered} trainable tensors; more than {MAX_TENSORS} is not a model"
    return None


def layout_pin_problem(expected_hash: str | None, offered_hash: str) -> str | None:
    if expected_hash and offered_hash != expected_hash:
        return (f"the model's layout hash is {offered_hash}, but this synchronizer was started with --layout-hash "
                f"{expected_hash}; join with the run's model (and its --num-fragments)")
    return None


def pinned_num_islands(pinned: int | None, checkpointed: int, directory: Path | None) -> int:
    """The run's island count: the operator's (``--num-islands``) or the checkpoint's (0: not yet known),
    which must agree."""
    if pinned is not None and not 1 <= pinned <= MAX_ISLANDS:
        raise ValueError(f"--num-islands {pinned}: need 1 to {MAX_ISLANDS}")
    if pinned and checkpointed and pinned != checkpointed:
        raise ValueError(f"--num-islands {pinned}, but the run in {directory} has num_islands={checkpointed}; pass "
                         f"--num-islands {checkpointed} (or none), or start a new run with a new --checkpoint-dir")
    return pinned or checkpointed


def running_message(running: IslandRunning) -> str:
    """Why a join as an island that is running elsewhere is refused, and what to do."""
    i = running.island
    return (f"island {i} is already running: its session was heard from {running.silent:.1f} s ago (a running island "
            f"heartbeats every second), and this join comes from another process. Give each island its own index "
            f"(DILOCO_ISLAND); to restart island {i}, stop its running process: the restart is let in once the old one "
            f"has been silent for {running.window:g} s (its client retries meanwhile)")


def fitted_to_model(config: RunConfig, tensors: int) -> RunConfig:
    """``config`` with at most one fragment per tensor of a model of ``tensors`` trainable
    tensors (tensors are never split): the run's settings the synchronizer takes for it."""
    if not 0 < tensors < config.schedule.num_fragments:
        return config
    return dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, num_fragments=tensors))


def fragments_lowered(wanted: int, tensors: int) -> str:
    return (f"num_fragments lowered from {wanted} to {tensors}: the first island's model has {tensors} trainable "
            "tensors (the strategy's num_fragments=, or the synchronizer's --num-fragments, sets fewer)")


def resumed_settings(given: RunConfig, restored: SynchronizerState) -> tuple[RunConfig, str | None]:
    """The restored run's settings, which its checkpoint holds as the run went, and what the
    synchronizer chose itself (a fragment count lowered to the model's tensors), said again as it
    was the first time (None: nothing); a setting given otherwise is named in a warning."""
    tensors = len(restored.layout.specs)
    fitted = fitted_to_model(given, tensors)
    lowered = fitted != given and restored.config.schedule.num_fragments == tensors
    differ = [f"{s.name}={value_of(restored.config, s.name)!r} (given: {value_of(fitted, s.name)!r})"
              for s in run_settings() if value_of(restored.config, s.name) != value_of(fitted, s.name)]
    if differ:
        log.warning("resuming with the run's settings as its checkpoint holds them, which differ from the ones "
                    "given: %s; a run's settings are fixed when it starts (a new run needs a new checkpoint)",
                    ", ".join(differ))
    return restored.config, fragments_lowered(given.schedule.num_fragments, tensors) if lowered else None
