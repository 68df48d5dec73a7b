"""The synchronizer's rounds: validate, reconstruct, wait for quorum and grace, merge, step, publish.

Transport-agnostic: the gRPC server and in-process callers drive the same object. Each fragment
has its own lock and open round, so rounds of different fragments never wait on each other.
Every refusal is a :class:`Refusal` with a short reason code that Status counts.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_diloco.core.codecs import Payload, get_codec
from lightning_diloco.core.config import CODECS, RunConfig
from lightning_diloco.core.fragments import FragmentLayout, TensorSpec, build_layout, split_fragment
from lightning_diloco.core.merge import NormOutlierGuard, contribution_weight, merge_outer_gradients
from lightning_diloco.core.quorum import RoundView, decide
from lightning_diloco.core.state import SynchronizerState, owned_by_shard

log = logging.getLogger(__name__)

MAX_TOKENS = 1e15
MAX_STEPS = 10**9


class Refusal(Exception):
    """A request the synchronizer will not act on. The global state is untouched.

    ``reason`` is a short code (counted in Status); ``status`` names the gRPC status code the
    transport answers with; the message says what was wrong and how to fix it.
    """

    def __init__(self, reason: str, message: str, status: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.reason, self.status = reason, status


@dataclass(frozen=True, kw_only=True)
class Contribution:
    island: int
    fragment: int
    base_version: int
    tokens: float
    steps: int
    codec: str
    seq: int
    payload: Payload
    layout_hash: str


@dataclass(frozen=True, kw_only=True)
class Reply:
    """The new global fragment for one island, as a delta against that island's base."""

    fragment: int
    version: int
    base_version: int
    codec: str
    payload: torch.Tensor
    contributors: int
    reason: str


@dataclass
class _Pending:
    seq: int
    base_version: int
    base: torch.Tensor
    outer_gradient: torch.Tensor
    weight: float
    norm: float


@dataclass
class _Slot:
    """One fragment's lock, open round and bookkeeping."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[int, _Pending] = field(default_factory=dict)
    opened_at: float | None = None
    quorum_at: float | None = None
    done: dict[int, _Done] = field(default_factory=dict)  # island -> its last merged contribution
    guard: NormOutlierGuard | None = None
    last_round: dict = field(default_factory=dict)
    # Every island whose base was the same version gets the same downlink payload: encode it
    # once per round, not once per island. Keyed by (new version, base version).
    replies: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


@dataclass
class _Island:
    world_size: int
    last_seen: float
    steps: int = 0
    step_time: float = 0.0
    accepted: int = 0


class Synchronizer:
    def __init__(
        self,
        config: RunConfig,
        *,
        shard: int = 0,
        num_shards: int = 1,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        liveness_timeout: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        state: SynchronizerState | None = None,
    ) -> None:
        """``checkpoint_every``: outer steps between checkpoints (0: only on close).

        ``liveness_timeout``: seconds without a heartbeat (or any request) after which an island
        is no longer waited for. ``state``: start from this state (e.g. restored from an island's
        checkpoint) unless ``checkpoint_dir`` holds one.
        """
        self.config = config
        self.owned = owned_by_shard(shard, num_shards)
        self.shard, self.num_shards = shard, num_shards
        self.incarnation = uuid.uuid4().hex[:12]  # per-process counters (accepted, refused) restart with it
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.liveness_timeout = liveness_timeout
        self.clock = clock
        self.lock = threading.RLock()  # islands, counters, layout adoption
        self.checkpoint_lock = threading.Lock()
        self.islands: dict[int, _Island] = {}
        self.closing = threading.Event()  # set on shutdown: waiting calls return at once
        self.accepted: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.bytes_in = self.bytes_out = 0
        self.sync_time = 0.0
        self.state: SynchronizerState | None = state
        self.last_checkpoint_steps = state.outer_steps if state else 0
        loaded = SynchronizerState.load(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        if loaded is not None:
            self.state = loaded
            if loaded.config != config:
                log.warning("resuming with the checkpoint's run settings, which differ from the ones given")
            self.config = loaded.config
            self.last_checkpoint_steps = loaded.outer_steps
            log.info("resumed from %s at versions %s", self.checkpoint_dir, loaded.versions())
        self.slots = {p: self._new_slot() for p in range(self.config.schedule.num_fragments) if self.owned(p)}

    def _new_slot(self) -> _Slot:
        merge = self.config.merge
        return _Slot(guard=NormOutlierGuard(merge.outlier_z, merge.outlier_window) if merge.outlier_z else None)

    # ---- refusals -------------------------------------------------------------------------

    def refuse(self, reason: str, message: str, status: str = "INVALID_ARGUMENT") -> Refusal:
        with self.lock:
            self.refused[reason] += 1
        log.warning("refused (%s): %s", reason, message)
        return Refusal(reason, message, status)

    def refuse_auth(self, message: str) -> Refusal:
        return self.refuse("unauthenticated", message, "UNAUTHENTICATED")

    def expected_payload_bytes(self, codec_name: str, fragment: int) -> int:
        """Bytes a payload of ``fragment`` must have in ``codec_name``; refuses unknown ones."""
        self._slot(fragment)
        self._check_codec(codec_name)
        numel = self.state.layout.fragment_numel(fragment)
        return get_codec(codec_name, self.config.codec.block_size).encoded_size(numel)

    # ---- membership -----------------------------------------------------------------------

    def join(self, island: int, world_size: int, specs: Sequence[TensorSpec]) -> dict:
        """Register an island; returns the run settings, layout hash and fragment versions."""
        if island < 0 or world_size < 1:
            raise self.refuse("bad_island", f"island={island} world_size={world_size}: need island >= 0 and world_size >= 1")
        try:
            layout = build_layout(list(specs), self.config.schedule.num_fragments)
        except ValueError as err:
            raise self.refuse("layout_mismatch", str(err), "FAILED_PRECONDITION") from None
        with self.lock:
            if self.state is None:
                self.state = SynchronizerState(self.config, layout, {})
                log.info("run layout adopted from island %d: %d tensors, hash %s", island, len(specs), layout.hash)
            elif self.state.layout.hash != layout.hash:
                raise self.refuse("layout_mismatch", _layout_difference(self.state.layout, layout), "FAILED_PRECONDITION")
            self.islands[island] = _Island(world_size=world_size, last_seen=self.clock())
        return {
            "config": self.config.to_dict(),
            "layout_hash": layout.hash,
            "versions": self.versions(),
            "owned": sorted(self.slots),
        }

    def heartbeat(self, island: int, steps: int, step_time: float) -> None:
        with self.lock:
            info = self.islands.get(island)
            if info is None:
                raise self.refuse("not_joined", f"island {island} sent a heartbeat before joining; call Join first", "FAILED_PRECONDITION")
            info.last_seen, info.steps = self.clock(), int(steps)
            if step_time > 0 and step_time == step_time:  # ignore NaN and nonsense
                info.step_time = float(step_time)
        for slot in self.slots.values():  # liveness may have changed what a round waits for
            with slot.cond:
                slot.cond.notify_all()

    def live_islands(self, now: float | None = None) -> set[int]:
        now = self.clock() if now is None else now
        with self.lock:
            return {i for i, info in self.islands.items() if now - info.last_seen <= self.liveness_timeout}

    def _step_time(self, live: set[int]) -> float:
        with self.lock:
            times = [self.islands[i].step_time for i in live if self.islands[i].step_time > 0]
        return statistics.median(times) if times else 0.0

    def versions(self) -> dict[int, int]:
        """Fragment versions this shard owns; -1 for a fragment not seeded yet."""
        state = self.state
        return {p: (state.fragments[p].version if state and p in state.fragments else -1) for p in self.slots}

    # ---- seeding and pulling ----------------------------------------------------------------

    def _slot(self, fragment: int) -> _Slot:
        slot = self.slots.get(fragment)
        if slot is None:
            owner = fragment % self.num_shards
            raise self.refuse(
                "unknown_fragment",
                f"fragment {fragment} is not owned by shard {self.shard} of {self.num_shards} "
                f"(fragments 0..{self.config.schedule.num_fragments - 1}; shard {owner} owns it)",
                "OUT_OF_RANGE",
            )
        if self.state is None:
            raise self.refuse("not_joined", "no island has joined yet; call Join first", "FAILED_PRECONDITION")
        return slot

    def seed(self, island: int, fragment: int, payload: Payload) -> bool:
        """Offer version 0 of a fragment (fp32). The first offer wins; later ones are ignored."""
        slot = self._slot(fragment)
        numel = self.state.layout.fragment_numel(fragment)
        value = self._decode("fp32", payload, numel)
        with slot.cond:
            seeded = self.state.seed(fragment, value)
            slot.cond.notify_all()
        if seeded:
            log.info("fragment %d seeded by island %d", fragment, island)
        return seeded

    def pull(self, fragment: int, newer_than: int = -1, timeout: float = 0.0) -> tuple[int, torch.Tensor]:
        """(version, fp32 copy) of a fragment, waiting up to ``timeout`` s for one newer than given."""
        slot = self._slot(fragment)
        deadline = self.clock() + timeout
        with slot.cond:
            while True:
                frag = self.state.fragments.get(fragment)
                if frag is not None and frag.version > newer_than:
                    return frag.version, frag.value.clone()
                left = deadline - self.clock()
                if left <= 0 or self.closing.is_set():
                    if frag is None:
                        raise self.refuse("not_seeded", f"fragment {fragment} has no value yet; seed it first", "FAILED_PRECONDITION")
                    return frag.version, frag.value.clone()
                slot.cond.wait(min(left, 0.25))

    # ---- contributions ---------------------------------------------------------------------

    def _check_codec(self, codec_name: str) -> None:
        if codec_name not in CODECS:
            raise self.refuse("unknown_codec", f"codec {codec_name!r} is not one of {', '.join(CODECS)}")

    def _decode(self, codec_name: str, payload: Payload, numel: int) -> torch.Tensor:
        self._check_codec(codec_name)
        try:
            return get_codec(codec_name, self.config.codec.block_size).decode(payload, numel)
        except ValueError as err:
            reason = "non_finite" if "non-finite" in str(err) else "bad_payload"
            raise self.refuse(reason, str(err)) from None

    def _validate(self, c: Contribution) -> tuple[_Slot, torch.Tensor]:
        slot = self._slot(c.fragment)
        with self.lock:
            if c.island not in self.islands:
                raise self.refuse("not_joined", f"island {c.island} pushed before joining; call Join first", "FAILED_PRECONDITION")
            self.islands[c.island].last_seen = self.clock()
        if c.layout_hash != self.state.layout.hash:
            raise self.refuse("layout_mismatch", f"layout hash {c.layout_hash!r} is not the run's {self.state.layout.hash!r}; rejoin with the run's model", "FAILED_PRECONDITION")
        if not (1 <= c.steps <= MAX_STEPS) or not (0 < c.tokens <= MAX_TOKENS) or c.tokens != c.tokens:
            raise self.refuse("bad_counters", f"counters tokens={c.tokens} steps={c.steps} are out of range (0 < tokens <= {MAX_TOKENS:g}, 1 <= steps <= {MAX_STEPS})")
        if c.seq < 0:
            raise self.refuse("bad_sequence", f"sequence number {c.seq} must be >= 0")
        delta = self._decode(c.codec, c.payload, self.state.layout.fragment_numel(c.fragment))
        with self.lock:
            self.bytes_in += _payload_size(c.payload)
        return slot, delta

    def push(self, c: Contribution, timeout: float = 60.0) -> Reply:
        """Add a contribution to its fragment's open round and return the merged result.

        Blocks until the round closes or ``timeout`` s pass (``TimeoutError``; the contribution
        stays in the round, and a retry with the same sequence number waits for the same result).
        A retry of an already merged contribution gets the same reply again, never a second merge.
        """
        slot, delta = self._validate(c)
        start = self.clock()
        with slot.cond:
            frag = self.state.fragments.get(c.fragment)
            if frag is None:
                raise self.refuse("not_seeded", f"fragment {c.fragment} has no value yet; seed it first", "FAILED_PRECONDITION")
            done = slot.done.get(c.island)
            if done is not None and c.seq < done.seq:
                raise self.refuse("old_sequence", f"sequence {c.seq} of island {c.island} is older than its last merged one ({done.seq})", "FAILED_PRECONDITION")
            if done is not None and c.seq == done.seq:
                with self.lock:
                    self.accepted["duplicate"] += 1
            else:
                pending = slot.pending.get(c.island)
                if pending is None or pending.seq != c.seq:
                    self._add(slot, frag, c, delta)
                self._wait_for_merge(c, slot, start, timeout)
            reply = self._reply(slot, c.fragment, c.island)
        self._maybe_checkpoint()
        return reply

    def _wait_for_merge(self, c: Contribution, slot: _Slot, start: float, timeout: float) -> None:
        while (done := slot.done.get(c.island)) is None or done.seq != c.seq:
            if self.closing.is_set():  # the contribution stays in the round for the checkpoint-free restart
                raise TimeoutError(f"round of fragment {c.fragment} still open: the synchronizer is shutting down")
            now = self.clock()
            decision = self._decision(slot, now)
            if decision.close:
                self._close(c.fragment, slot, decision.reason, now)
                continue
            left = start + timeout - now
            if left <= 0:
                raise TimeoutError(f"round of fragment {c.fragment} still open after {timeout:.1f}s: {decision.reason}")
            wait = left if decision.deadline is None else max(0.0, min(left, decision.deadline - now))
            slot.cond.wait(min(wait, 0.25))  # wake up now and then: islands may have died

    def _add(self, slot: _Slot, frag, c: Contribution, delta: torch.Tensor) -> None:
        base = frag.base(c.base_version)
        if base is None:
            raise self.refuse(
                "stale",
                f"base version {c.base_version} of fragment {c.fragment} is not among the kept versions "
                f"{sorted(frag.history)}; pull the fragment and contribute against a newer base",
                "FAILED_PRECONDITION",
            )
        outer_gradient = frag.outer_gradient(c.base_version, delta)
        norm = float(torch.linalg.vector_norm(outer_gradient))
        if slot.guard is not None and (why := slot.guard.check(norm)):
            raise self.refuse("outlier", why)
        age = frag.version - c.base_version
        weight = contribution_weight(c.tokens, c.steps, age=age, staleness_discount=self.config.merge.staleness_discount)
        slot.pending[c.island] = _Pending(c.seq, c.base_version, base, outer_gradient, weight, norm)
        now = self.clock()
        if slot.opened_at is None:
            slot.opened_at = now
        if slot.quorum_at is None and len(slot.pending) >= self.config.merge.min_quorum:
            slot.quorum_at = now
        slot.cond.notify_all()

    def _decision(self, slot: _Slot, now: float):
        live = self.live_islands(now)
        view = RoundView(contributors=frozenset(slot.pending), live=frozenset(live), opened_at=slot.opened_at or now, quorum_at=slot.quorum_at)
        return decide(
            view,
            now,
            min_quorum=self.config.merge.min_quorum,
            gamma=self.config.merge.grace_gamma,
            overlap_steps=self.config.schedule.overlap_steps,
            step_time=self._step_time(live),
            sync_time=self.sync_time,
        )

    def _close(self, fragment: int, slot: _Slot, reason: str, now: float) -> None:
        """Merge the open round into one outer step. Called with ``slot.cond`` held."""
        started = time.perf_counter()
        islands = sorted(slot.pending)
        pendings = [slot.pending[i] for i in islands]
        specs = self.state.layout.fragment_specs(fragment)
        merged = torch.empty(self.state.layout.fragment_numel(fragment))
        merge_outer_gradients(
            [split_fragment(p.outer_gradient, specs) for p in pendings],
            [p.weight for p in pendings],
            [s.role for s in specs],
            self.config.merge.method,
            out=split_fragment(merged, specs),
        )
        version = self.state.apply(fragment, merged)
        for island, p in zip(islands, pendings):
            slot.done[island] = _Done(p.seq, version, p.base_version, p.base)
            if slot.guard is not None:
                slot.guard.record(p.norm)
        slot.last_round = {
            "version": version,
            "contributors": len(islands),
            "grace_wait_s": max(0.0, now - slot.quorum_at) if slot.quorum_at is not None else 0.0,
            "reason": reason,
        }
        slot.pending.clear()
        slot.replies.clear()
        slot.opened_at = slot.quorum_at = None
        elapsed = time.perf_counter() - started
        with self.lock:
            self.accepted["merged"] += len(islands)
            for island in islands:
                if island in self.islands:
                    self.islands[island].accepted += 1
            self.sync_time = elapsed if not self.sync_time else 0.8 * self.sync_time + 0.2 * elapsed
        log.debug("fragment %d -> version %d from islands %s (%s)", fragment, version, islands, reason)
        slot.cond.notify_all()

    def _reply(self, slot: _Slot, fragment: int, island: int) -> Reply:
        done = slot.done[island]
        frag = self.state.fragments[fragment]
        new = frag.base(done.version)
        base = done.base if done.base is not None else frag.base(done.base_version)
        if new is None or base is None:
            raise self.refuse(
                "result_expired",
                f"contribution {done.seq} of island {island} was merged into version {done.version}, "
                "which is no longer kept; pull the fragment instead",
                "FAILED_PRECONDITION",
            )
        done.base = None  # delivered: a replay can rebuild it from history while it lasts
        codec = get_codec(self.config.codec.downlink, self.config.codec.block_size)
        key = (done.version, done.base_version)
        payload = slot.replies.get(key)
        if payload is None:
            payload = slot.replies[key] = codec.encode(new - base)
        with self.lock:
            self.bytes_out += payload.numel()
        return Reply(
            fragment=fragment,
            version=done.version,
            base_version=done.base_version,
            codec=codec.name,
            payload=payload,
            contributors=slot.last_round.get("contributors", 0),
            reason=slot.last_round.get("reason", ""),
        )

    # ---- durability and status ----------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        if self.checkpoint_dir is None or self.checkpoint_every <= 0 or self.state is None:
            return
        if self.state.outer_steps - self.last_checkpoint_steps >= self.checkpoint_every:
            self.checkpoint()

    def checkpoint(self) -> Path | None:
        """Write an atomic checkpoint now (no-op without a directory or a state)."""
        if self.checkpoint_dir is None or self.state is None:
            return None
        with self.checkpoint_lock:
            snapshot = self.snapshot()
            path = snapshot.save(self.checkpoint_dir)
            self.last_checkpoint_steps = snapshot.outer_steps
        log.debug("checkpoint at %d outer steps: %s", snapshot.outer_steps, path)
        return path

    def shutdown(self) -> None:
        """Release every call waiting on a round or a pull (a stopping server must not wait)."""
        self.closing.set()
        for slot in self.slots.values():
            with slot.cond:
                slot.cond.notify_all()

    def snapshot(self) -> SynchronizerState:
        """A consistent copy of the state, fragment by fragment.

        Each fragment is copied under its own lock: fragments are independent, so taking a
        snapshot never stalls every round at once.
        """
        assert self.state is not None, "no island has joined: nothing to snapshot"
        snapshot = SynchronizerState(self.config, self.state.layout, {})
        for p, slot in self.slots.items():
            with slot.cond:
                frag = self.state.fragments.get(p)
                if frag is not None:
                    snapshot.seed(p, frag.value)
                    snapshot.fragments[p].load_state_dict(frag.state_dict())
        snapshot.outer_steps = sum(f.version for f in snapshot.fragments.values())
        return snapshot

    def status(self) -> dict:
        now = self.clock()
        live = self.live_islands(now)
        with self.lock:
            islands = {
                i: {
                    "live": i in live,
                    "world_size": info.world_size,
                    "steps": info.steps,
                    "step_time_s": info.step_time,
                    "accepted": info.accepted,
                    "seen_s_ago": now - info.last_seen,
                }
                for i, info in sorted(self.islands.items())
            }
            counters = {
                "accepted": dict(self.accepted),
                "refused": dict(self.refused),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
            }
        rounds = {}
        for p, slot in self.slots.items():
            with slot.cond:
                rounds[p] = {"open_contributors": len(slot.pending), **slot.last_round}
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "incarnation": self.incarnation,
            "layout_hash": self.state.layout.hash if self.state else "",
            "outer_steps": self.state.outer_steps if self.state else 0,
            "versions": self.versions(),
            "min_quorum": self.config.merge.min_quorum,
            "live_islands": sorted(live),
            "islands": islands,
            "rounds": rounds,
            **counters,
        }


@dataclass
class _Done:
    seq: int
    version: int
    base_version: int
    base: torch.Tensor | None  # held until the reply is delivered, even if history moves on


def _payload_size(payload: Payload) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


def _layout_difference(run: FragmentLayout, other: FragmentLayout) -> str:
    for mine, theirs in zip(run.specs, other.specs):
        if mine != theirs:
            return f"model layout differs from the run's at tensor {mine.name!r}: run has {mine}, island has {theirs}; every island must train the same model"
    return (
        f"model layout differs from the run's: run has {len(run.specs)} tensors, island has {len(other.specs)}; "
        "every island must train the same model"
    )
