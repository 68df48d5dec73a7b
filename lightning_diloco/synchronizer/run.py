"""The run as one synchronizer holds it: :class:`Run`, its settings, layout and island count, fixed
by the first joiners (:meth:`Run.adopt`, :meth:`Run.count_stated`), the operator or a checkpoint
(the rules: admission.py), and the fragments this shard owns, each with its closer thread
(closers.py), made once the layout is known.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import FragmentLayout, TensorSpec, build_layout
from lightning_diloco.core.quorum import quorum_in_run
from lightning_diloco.core.schedule import due_step, fragment_offsets
from lightning_diloco.core.state import SynchronizerState, owned_by_shard, shard_of
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer import version_log
from lightning_diloco.synchronizer.admission import (
    count_agreed,
    fitted_to_model,
    fragments_lowered,
    layout_pin_problem,
    num_islands_problem,
    resumed_settings,
    tensor_count_problem,
)
from lightning_diloco.synchronizer.closers import Closers
from lightning_diloco.synchronizer.fragment import Fragment, Shared
from lightning_diloco.synchronizer.requests import layout_difference
from lightning_diloco.synchronizer.settings import SynchronizerSettings

log = logging.getLogger(__name__)


class Run:
    def __init__(self, config: RunConfig, state: SynchronizerState | None, settings: SynchronizerSettings, *,
                 num_islands: int, shared: Shared, logged: dict[int, list[tuple[int, str]]], closing: threading.Event) -> None:
        """``state``: the run's, restored (None: no island has joined yet; then ``config`` is the
        run's settings until the first joiner's model fits them). ``num_islands``: the run's island
        count, the operator's or the checkpoint's (0: not yet known). ``logged``: each fragment's
        versions in the version log; ``closing``: set on shutdown."""
        self.config, self.state, self.shared, self.logged = config, state, shared, logged
        self.shard, self.num_shards, self.owned = settings.shard, settings.num_shards, owned_by_shard(settings.shard, settings.num_shards)
        self.layout_hash, self.num_islands = settings.layout_hash, num_islands  # the layout pinned (None: the first joiner's)
        self.lock = threading.RLock()  # layout adoption, the run's island count, start
        self.adjustments: list[str] = []  # settings changed to fit the run, said in the log and Status
        if state is not None:  # a resumed run keeps the settings it ran with, those it chose itself included
            self.config, lowered = resumed_settings(config, state)
            self.adjustments += [lowered] if lowered else []
        self.stated_counts: dict[int, int] = {}  # island -> the num_islands it was started with, while the run's is not known
        self.offsets = fragment_offsets(self.config.schedule.num_fragments, self.config.schedule.sync_every)
        self.fragments: dict[int, Fragment] = {}  # the owned ones, once the run has a layout
        self.closers = Closers(self.fragments, shared.membership, clock=shared.clock, closing=closing, quorum=self.quorum)
        self.started = False
        if self.state is not None:
            self._make_fragments(self.state)

    def start(self) -> None:
        """Run one closer thread per owned fragment, now or once the layout is adopted."""
        with self.lock:
            self.started = True
            self.closers.start()

    def _make_fragments(self, state: SynchronizerState) -> None:
        """(Once the run's state, layout and schedule are settled.)"""
        layout = state.layout
        for p in range(layout.num_fragments):
            if self.owned(p) and p not in self.fragments:
                self.fragments[p] = Fragment(p, layout.fragment_specs(p), self.offsets[p], self.config, state,
                                             self.shared, self.logged.get(p, []))
        if self.started:
            self.closers.start()

    def fragment(self, fragment: int) -> Fragment:
        """The owned fragment ``fragment``, once the run has a layout (push admission steps 1-2)."""
        num_fragments, tally = self.config.schedule.num_fragments, self.shared.tally
        if not 0 <= fragment < num_fragments:  # (no shard owns it: saying one did sent clients to the wrong one)
            raise tally.refuse(Reason.UNKNOWN_FRAGMENT, f"fragment {fragment} is not one of the run's fragments "
                               f"0..{num_fragments - 1}")
        if not self.owned(fragment):
            raise tally.refuse(Reason.UNKNOWN_FRAGMENT, f"fragment {fragment} is not owned by shard {self.shard} of "
                               f"{self.num_shards}; shard {shard_of(fragment, self.num_shards)} owns it")
        owned = self.fragments.get(fragment)
        if self.state is None or owned is None:
            raise tally.refuse(Reason.NOT_JOINED, "no island has joined yet; call Join first")
        return owned

    # ---- joining ------------------------------------------------------------------------------

    def admit_join(self, tensors: int) -> None:
        """A join's checks before its tensors are read (the server calls it with their count)."""
        state = self.state
        problem = tensor_count_problem(tensors, None if state is None else len(state.layout.specs))
        if problem:
            raise self.shared.tally.refuse(Reason.LAYOUT_MISMATCH, problem)

    def adopt(self, island: int, specs: Sequence[TensorSpec], num_islands: int) -> FragmentLayout:
        """The joiner's layout, checked against the run's; the first joiner's becomes the run's
        (unless pinned). ``num_islands``: the count the joiner was started with (0: not said),
        checked before its layout is adopted: a refused joiner decides nothing."""
        tally = self.shared.tally
        with self.lock:
            if self.state is None and 0 < len(specs) < self.config.schedule.num_fragments:
                self._fit_fragments(len(specs))
        try:
            layout = build_layout(list(specs), self.config.schedule.num_fragments)
        except ValueError as err:
            raise tally.refuse(Reason.LAYOUT_MISMATCH, str(err)) from None
        with self.lock:
            problem = num_islands_problem(island, num_islands, self.num_islands)
            if problem:
                raise tally.refuse(Reason.NUM_ISLANDS_MISMATCH, problem)
            if self.state is None:
                problem = layout_pin_problem(self.layout_hash, layout.hash)
                if problem:
                    raise tally.refuse(Reason.LAYOUT_MISMATCH, problem)
                self.state = SynchronizerState(self.config, layout, {})
                self._make_fragments(self.state)
                log.info("run layout adopted from island %d: %d tensors, hash %s", island, len(specs), layout.hash)
            elif self.state.layout.hash != layout.hash:
                raise tally.refuse(Reason.LAYOUT_MISMATCH, layout_difference(self.state.layout, layout))
        return layout

    def _fit_fragments(self, tensors: int) -> None:
        """The first island's model has fewer tensors than fragments asked for (tensors are never
        split): the run takes one fragment per tensor, as an embedded synchronizer does."""
        wanted = self.config.schedule.num_fragments
        self.config = fitted_to_model(self.config, tensors)
        self.offsets = fragment_offsets(tensors, self.config.schedule.sync_every)
        self.adjustments.append(fragments_lowered(wanted, tensors))
        log.warning("%s", self.adjustments[-1])

    def count_stated(self, island: int, num_islands: int) -> None:
        """A joined island said the count it was started with: the run's, once a quorum says it."""
        with self.lock:
            if self.num_islands:
                return
            self.stated_counts[island] = num_islands
            if count_agreed(self.stated_counts, num_islands):
                self.num_islands = num_islands
                self.stated_counts.clear()
                log.info("the run has num_islands=%d: a quorum of its islands was started with it", num_islands)

    # ---- what the run's rounds say ------------------------------------------------------------

    def quorum(self) -> int:
        """The contributors a round needs now: K, at most the islands still in the run."""
        left = self.shared.membership.left_count()
        return quorum_in_run(self.config.merge.min_quorum, num_islands=self.num_islands, left=left)

    def run_step(self, now: float | None = None) -> int:
        """The run's clock: the live islands' (robust: membership.py); with none live (a restarted
        synchronizer, or islands that all went away) the step of the latest round any fragment
        opened, which the first island to join again starts from. Not the later of the two: a
        round one island opened ahead of the others would then place every island that joins or
        rejoins at it, and carry the clock with them."""
        clock = self.shared.membership.run_step(self.shared.clock() if now is None else now)
        if clock is not None:
            return clock
        latest, state = 0, self.state
        if state is not None:
            H = self.config.schedule.sync_every
            for p, frag in list(state.fragments.items()):
                if frag.next_round > 0:
                    latest = max(latest, due_step(frag.next_round - 1, self.offsets[p], H))
        return latest

    def wake(self) -> None:
        """Liveness or the quorum changed (or shutdown): every round looks again at what it waits for."""
        for fragment in self.fragments.values():
            fragment.wake()

    # ---- recovery after a restart (fragment.py) ------------------------------------------------

    def fall_back_if_overdue(self) -> None:
        """Each recovering fragment falls back once the restart settled or its wait is over."""
        now = self.shared.clock()
        for fragment in list(self.fragments.values()):
            fragment.fall_back_if_overdue(now)

    def await_recovery(self, fragment: Fragment, island: int) -> None:
        """Wait while ``fragment`` recovers and ``island``, which offered what it holds, has nothing
        to give back (fragment.py ``awaits_recovery``); the restart's settling, which may end the
        recovery, is looked at here, outside the fragment's lock."""
        until = time.monotonic() + version_log.RECOVERY_PULL_WAIT  # read at the call: a test shortens it
        self.fall_back_if_overdue()
        while fragment.awaits_recovery(island, until):
            self.fall_back_if_overdue()

    def outer_steps(self) -> int:
        """Outer steps the run has taken on this shard (Status): a restarted synchronizer's
        fragment that waits for an island to give back its last version counts that version, so
        the count never goes back across a restart unless versions are lost (fragment.py)."""
        return sum(fragment.outer_steps() for fragment in list(self.fragments.values()))

    def snapshot(self, identity: dict) -> SynchronizerState | None:
        """A consistent copy of the state (None before the first join), fragment by fragment: each
        under its own lock (fragments are independent, so a snapshot never stalls every round)."""
        if self.state is None:
            return None
        snapshot = SynchronizerState(self.config, self.state.layout, {})
        snapshot.identity, snapshot.num_islands = dict(identity), self.num_islands
        snapshot.left = self.shared.membership.left_islands()
        for fragment in self.fragments.values():
            fragment.save_into(snapshot)
        return snapshot
