"""The island leader's background work: pushes on its executor (a small thread pool) and a heartbeat.

Only rank 0 of an island talks to the synchronizer. Its training loop never waits for the
network: a send hands the snapshot to :meth:`LeaderSync.push`, which forms the outer gradient,
encodes it and pushes it on the executor; the heartbeat, repeated by the island's clock (a thread
of its own), reports the island's progress every second.
Both record whether the synchronizer answered, through one method with one meaning:
:attr:`LeaderSync.reachable` is whether its latest answer to this island, to a heartbeat or a
push, was a success.
An island whose inbox summed steps of a fragment (its copy then rounds away from the published
value, inbox.py) has the leader pull that fragment whole on the executor (:meth:`LeaderSync.want_whole`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

from lightning_diloco.core.codecs import Codec
from lightning_diloco.core.feedback import UplinkFeedback
from lightning_diloco.core.outer import island_delta
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.learner.clock import SYSTEM_CLOCK, Clock
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.learner.link import SynchronizerLink
from lightning_diloco.learner.staging import HostCopy

log = logging.getLogger(__name__)

WHOLE_PULL_TRIES = 3
"""Pulls of a fragment whole per :meth:`LeaderSync.want_whole` (or heartbeat) while each answer
races a version on the stream (:meth:`~lightning_diloco.learner.inbox.Inbox.put_pulled`)."""
STREAM_CATCH_UP_S = 5.0
"""How long a pull's answer ahead of the stream waits for the stream to bring its version."""


def sync_pool(island: int, workers: int) -> ThreadPoolExecutor:
    """The leader's executor by default: ``workers`` threads whose torch ops run single-threaded,
    so the training loop keeps its OpenMP team (core/threads.py)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"diloco-island{island}-sync",
                              initializer=single_threaded_torch)


class LeaderSync:
    def __init__(self, link: SynchronizerLink, *, island: int, uplink: Codec, feedback: bool, layout_hash: str,
                 executor: Executor, progress: Callable[[], tuple[int, float, int]], heartbeat_every: float = 1.0,
                 holds: Callable[[int], tuple[int, torch.Tensor] | None] = lambda p: None,
                 clock: Clock = SYSTEM_CLOCK, uplink_of: dict[int, Codec] | None = None) -> None:
        """``executor``: where pushes run (:func:`sync_pool`); the leader shuts it down when it
        closes. ``clock``: what repeats the heartbeat every ``heartbeat_every`` seconds.
        ``progress()``: (inner steps, seconds per step, schedule step), read by the heartbeat;
        ``feedback``: carry what a lossy ``uplink`` could not send into the next push
        (core/feedback.py); ``holds(p)``: (version, whole value) of the global fragment p this
        island holds (None: none, or not whole on the leader: the island gathers it at a step
        boundary and hands it over, :meth:`hold_gathered`), offered to a restarted synchronizer
        that waits for an island to give it back (synchronizer/version_log.py). ``uplink_of``:
        the fragments sent in another codec than ``uplink`` (``sparse_dense_tensors``); a push
        names its codec, so the synchronizer decodes each as sent."""
        self.link, self.island, self.uplink, self.layout_hash = link, island, uplink, layout_hash
        self.uplink_of = dict(uplink_of or {})
        self.feedback = UplinkFeedback(uplink) if feedback and not uplink.lossless else None
        self.progress, self.holds = progress, holds
        self.lock = threading.Lock()  # the counters and the give-back state below, written from several threads
        self._offered: set[tuple[int, int]] = set()
        """(fragment, version) offered in the recovery under way: each once; forgotten once the
        fragment is served again, so the next restart is offered it again."""
        self._waiting: frozenset[int] = frozenset()  # the fragments the latest heartbeat showed at -1
        self._gathered: tuple[int, int, torch.Tensor] | None = None
        """(fragment, version, whole value) gathered at a step boundary, until the next heartbeat
        offers it: one fragment at a time."""
        self.inbox: Inbox | None = None
        """The island's inbox (set once it opens), into which a fragment pulled whole is put."""
        self._pulling: set[int] = set()  # fragments whose pull is queued or under way: one at a time each
        self.bytes_up = 0
        self.late = 0
        self.reachable = True
        self.executor, self.clock, self.heartbeat_every = executor, clock, heartbeat_every
        self._stop = threading.Event()
        self._join_heartbeat: Callable[[float], None] | None = None

    def start_heartbeat(self) -> None:
        self._join_heartbeat = self.clock.every(self.heartbeat_every, self._beat, until=self._stop,
                                                name=f"diloco-island{self.island}-heartbeat")

    def push(self, *, fragment: int, round: int, local: torch.Tensor | HostCopy, base: torch.Tensor | None,
             base_version: int, tokens: float, steps: int, seq: int) -> Future:
        """Form, encode and push the whole fragment's progress since its base
        (:func:`~lightning_diloco.core.outer.island_delta` of ``local`` and ``base``; ``base``
        None: ``local`` is that progress already) in the background; the future holds the ack (or
        the refusal). ``local`` may be a :class:`~lightning_diloco.learner.staging.HostCopy` still
        being copied from the GPU: the pool thread waits for it, and sees host tensors only.
        Neither tensor may change until the push is done: the training thread hands over a
        snapshot and a base it replaces, never changes."""
        return self.executor.submit(self._push, fragment, round, local, base, base_version, tokens, steps, seq)

    def answered(self, ok: bool) -> None:
        """Record the synchronizer's latest answer (False: a push the island gave up on)."""
        with self.lock:
            self.reachable = ok

    def encode(self, fragment: int, local: torch.Tensor | HostCopy, base: torch.Tensor | None) -> torch.Tensor:
        """The push's payload: the fragment's progress since ``base`` in the uplink codec, with the
        residual of its last push (counted in ``bytes_up``); a ``local`` still being copied off the
        device is waited for here, off the training thread."""
        if isinstance(local, HostCopy):
            local = local.wait()
        delta = local if base is None else island_delta(local, base)
        codec = self.codec_of(fragment)
        payload = codec.encode(delta) if self.feedback is None else self.feedback.encode(fragment, delta, codec)
        with self.lock:
            self.bytes_up += payload.numel()
        return payload

    def codec_of(self, fragment: int) -> Codec:
        """The codec ``fragment``'s pushes go in."""
        return self.uplink_of.get(fragment, self.uplink)

    def _push(self, fragment, round, local, base, base_version, tokens, steps, seq):
        ack = self.link.push(Contribution(
            island=self.island, fragment=fragment, round=round, base_version=base_version, tokens=max(tokens, 1.0),
            steps=max(steps, 1), codec=self.codec_of(fragment).name, seq=seq, layout_hash=self.layout_hash,
            payload=self.encode(fragment, local, base),
        ))
        with self.lock:
            self.reachable = True
            self.late += ack.late
        return ack

    def _leave(self) -> None:
        """Tell the synchronizer the island is done, so that no round waits for it until its
        liveness timeout (with K = M the last island running waited out its push wait at every
        due fragment). Never raises: the synchronizer may be gone, and the island ends anyway."""
        try:
            self.link.leave(self.island)
        except Exception as err:  # noqa: BLE001 - the end of the run goes on without it
            log.warning("island %d: could not tell the synchronizer that it leaves the run (%s); rounds wait for it "
                        "until its liveness timeout", self.island, err)

    def _beat(self) -> None:
        steps, step_time, schedule_step = self.progress()
        try:
            beat = self.link.heartbeat(self.island, steps, step_time, schedule_step)
            self.answered(True)
        except Exception as err:  # noqa: BLE001 - liveness only; pushes report real failures
            self.answered(False)
            log.debug("island %d: heartbeat failed: %s", self.island, err)
            return
        waiting = [p for p, v in beat.versions.items() if v < 0]
        with self.lock:
            self._waiting = frozenset(waiting)
            self._offered = {(p, v) for p, v in self._offered if p in self._waiting}
        if self.inbox is not None:  # a pull that failed (or raced the stream each time) is made again,
            self._pull(self.inbox.wants_whole() - set(waiting))  # not of a fragment being recovered (refused)
        try:
            self._give_back(waiting)
        except Exception as err:  # noqa: BLE001 - the synchronizer serves its checkpoint's after its wait
            log.warning("island %d: offering a fragment back to the restarted synchronizer failed: %s", self.island, err)

    def _give_back(self, waiting: list[int]) -> None:
        """Offer the global fragments the synchronizer serves no version of (-1: restarted after
        publishing a version its checkpoint lacks) that this island holds: it takes one only if
        its digest is the logged version's, so this island's value need not be, and each
        (fragment, version) is offered once per recovery. A fragment no rank holds whole is offered
        once the island has gathered it (:meth:`to_gather`, :meth:`hold_gathered`)."""
        with self.lock:
            gathered = self._gathered
        try:
            for p in waiting:
                held = self.holds(p)
                if held is None and gathered is not None and gathered[0] == p:
                    held = gathered[1:]
                with self.lock:
                    if held is None or held[0] < 0 or (p, held[0]) in self._offered:
                        continue
                    self._offered.add((p, held[0]))
                try:
                    taken, version = self.link.seed(self.island, p, held[1])
                except BaseException:
                    with self.lock:  # not answered: offered again (gathered again) while it is still wanted
                        self._offered.discard((p, held[0]))
                    raise
                log.info("island %d: offered fragment %d at version %d to the restarted synchronizer: %s", self.island,
                         p, held[0], "taken" if taken else f"not taken (it serves version {version})")
        finally:
            with self.lock:  # offered, or no longer wanted: dropped (to_gather gathers none while it is kept)
                if gathered is not None and self._gathered is gathered:
                    self._gathered = None

    def want_whole(self, fragment: int) -> None:
        """(The inbox's ``on_summed``, on a reader thread.) The inbox summed steps of ``fragment``:
        pull it whole on the executor, once: not while a pull of it is queued or under way (its
        answer, put, covers every step summed before); a pull that does not put it is made again
        at the next heartbeat (:meth:`Inbox.wants_whole`)."""
        self._pull({fragment})

    def _pull(self, fragments: set[int]) -> None:
        with self.lock:
            todo = sorted(fragments - self._pulling)
            self._pulling.update(todo)
        for p in todo:
            try:
                self.executor.submit(self._pull_whole, p)
            except RuntimeError:  # the executor is shut down: the island is closing
                with self.lock:
                    self._pulling.discard(p)

    def _pull_whole(self, fragment: int) -> None:
        """Pull ``fragment`` whole and put it into the inbox (:meth:`Inbox.put_pulled` says when
        it is put): an answer behind the stream is pulled again, one ahead of it waits for the
        stream to bring its version first, up to :data:`WHOLE_PULL_TRIES` pulls."""
        inbox = self.inbox
        assert inbox is not None, "the inbox opens before its subscription, which alone sums steps"
        put = False
        try:
            for _ in range(WHOLE_PULL_TRIES):
                version, value = self.link.pull(fragment)
                put = inbox.put_pulled(fragment, version, value)
                if put:
                    break
                # ahead of the stream: wait for it to bring that version (behind: nothing to wait for)
                inbox.wait(lambda: inbox.received[fragment] >= version or self._stop.is_set(),  # noqa: B023 - waited here
                           STREAM_CATCH_UP_S)
                put = inbox.put_pulled(fragment, version, value)
                if put or self._stop.is_set():
                    break
            log.info("island %d: fragment %d pulled whole at version %d: %s", self.island, fragment, version,
                     "its copy is the published value again" if put else "it raced the stream's versions; pulled "
                     "again at the next heartbeat")
        except Exception as err:  # noqa: BLE001 - pulled again at the next heartbeat
            (log.debug if self._stop.is_set() else log.warning)(  # closing: the link was ended under it
                "island %d: pulling fragment %d whole failed (%s); again at the next heartbeat", self.island, fragment, err)
        finally:
            with self.lock:
                self._pulling.discard(fragment)
        if put and fragment in inbox.wants_whole():  # summed again since (the island took it): another event
            self._pull({fragment})

    def to_gather(self, candidates: dict[int, int]) -> int | None:
        """(The leader's step plan) which fragment the island gathers whole at this step boundary
        to give it back: of ``candidates`` (fragment -> version held, each held in parts and
        possibly the published value), one the latest heartbeat showed the restarted synchronizer
        waiting for and not yet offered at that version in this recovery; None while a gathered
        fragment waits for its offer (one whole fragment on the leader at a time)."""
        with self.lock:
            if self._gathered is not None:
                return None
            return next((p for p, v in sorted(candidates.items()) if p in self._waiting and (p, v) not in self._offered),
                        None)

    def hold_gathered(self, fragment: int, version: int, value: torch.Tensor) -> None:
        """Keep the whole ``value`` of ``fragment`` gathered at a step boundary for the next
        heartbeat's offer (dropped there if the synchronizer no longer waits for it)."""
        with self.lock:
            self._gathered = (fragment, version, value)

    def close(self) -> None:
        """Cancel queued pushes, leave the run, end the link (which cancels pushes in progress),
        join the threads."""
        self._stop.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._leave()
        self.link.close()
        self.executor.shutdown(wait=True)
        if self._join_heartbeat is not None:
            self._join_heartbeat(5)
