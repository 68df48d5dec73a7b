"""What one learner island does around its inner steps: snapshot, send, apply (DESIGN.md s2).

Framework-free: the Lightning strategy feeds it the model's parameters, calls :meth:`after_step`
after every inner optimizer step, and provides the island's collectives. Only the leader (rank 0
of the island) talks to the synchronizer, from a background thread pool; every decision that
changes the parameters is made by the leader and broadcast, so all ranks apply the same fragment
at the same step and enter the same collectives in the same order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import FragmentLayout, flatten_fragment, split_fragment
from lightning_diloco.core.schedule import due_fragment, fragment_offsets
from lightning_diloco.core.threads import single_threaded_torch

log = logging.getLogger(__name__)

# A push whose base the synchronizer no longer has is answered by pulling the current value.
REPULL_REASONS = ("stale", "result_expired", "old_sequence")
STATE_FORMAT = 1


class Collective:
    """Broadcasts from the island leader to its ranks; the identity for a one-process island."""

    world_size = 1

    def broadcast_object(self, obj):
        return obj

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class TorchCollective(Collective):
    """Broadcasts over the island's default torch.distributed group (rank 0 leads).

    ``device``: where tensors must be for the backend (the GPU for NCCL, the CPU for gloo).
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size, self.device = world_size, device

    def broadcast_object(self, obj):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self.device)
        torch.distributed.broadcast(moved, src=0)
        return moved.cpu() if moved is not tensor else tensor


@dataclass
class _Flight:
    fragment: int
    apply_at: int
    snapshot: torch.Tensor | None  # kept for apply='rebase'
    tokens_at_send: float
    steps_at_send: int
    future: Future | None  # leader only


class IslandLearner:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: FragmentLayout,
        config: RunConfig,
        *,
        island: int,
        link=None,
        collective: Collective | None = None,
        heartbeat_every: float = 1.0,
        push_wait: float = 120.0,
    ) -> None:
        """``params``: the model's trainable tensors in ``layout.specs`` order. ``link``: a
        :class:`~lightning_diloco.transport.client.SynchronizerClient` on the leader, None on
        other ranks. ``push_wait``: seconds a push may wait for its round to close."""
        assert len(params) == len(layout.specs), f"{len(params)=} != {len(layout.specs)=}"
        self.params, self.layout, self.config = list(params), layout, config
        self.island, self.link = island, link
        self.collective = collective or Collective()
        self.is_leader = link is not None
        sched = config.schedule
        self.offsets = fragment_offsets(layout.num_fragments, sched.sync_every)
        self.uplink = get_codec(config.codec.uplink, config.codec.block_size)
        self.downlink = get_codec(config.codec.downlink, config.codec.block_size)
        self.push_wait = push_wait

        P = layout.num_fragments
        self.step = 0
        self.versions = [0] * P
        self.bases: list[torch.Tensor] = [flatten_fragment(self._fragment_params(p)) for p in range(P)]
        self.tokens = [0.0] * P
        self.steps = [0] * P
        self.seq = time.time_ns() // 1000  # increasing across restarts: the synchronizer dedups by it
        self.in_flight: dict[int, _Flight] = {}
        self.counters = dict.fromkeys(("sent", "applied", "skipped", "failed", "repulled"), 0)
        self.bytes_up = self.bytes_down = 0
        self.blocked_s = 0.0
        self.staleness = 0
        self.reachable = True
        self._step_time = 0.0
        self._last_step_at: float | None = None

        self._executor: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if self.is_leader:
            workers = min(P, sched.overlap_steps + 2)
            self._executor = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"diloco-island{island}-sync", initializer=single_threaded_torch
            )
            self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_every,), name=f"diloco-island{island}-heartbeat", daemon=True)

    # ---- joining ----------------------------------------------------------------------------

    def _fragment_params(self, p: int) -> list[torch.Tensor]:
        return [self.params[i] for i in self.layout.fragments[p]]

    def start(self, resume: dict | None = None) -> None:
        """Seed unseeded fragments, pull every global fragment and start from the global model.

        With ``resume`` (a :meth:`state_dict`), fragments whose global version is still the one
        saved keep their local values and counters: the run continues as if never stopped.
        """
        if resume is not None:
            self.load_state_dict(resume)
        plan = None
        if self.is_leader:
            plan = self._pull_global(resume)
        plan = self.collective.broadcast_object(plan)
        for p, version in plan["versions"].items():
            value = self.bases[p] if self.is_leader else torch.empty(self.layout.fragment_numel(p))
            value = self.collective.broadcast_tensor(value)
            self.bases[p], self.versions[p] = value, version
            if p in plan["overwrite"]:
                self.write_fragment(p, value)
                self.tokens[p], self.steps[p] = 0.0, 0
        if self._heartbeat is not None:
            self._heartbeat.start()
        log.info("island %d joined at versions %s (%d fragments from the global model)", self.island, self.versions, len(plan["overwrite"]))

    def _pull_global(self, resume: dict | None) -> dict:
        versions = self.link.heartbeat(self.island, self.step, 0.0)
        for p, version in sorted(versions.items()):
            if version < 0:
                self.link.seed(self.island, p, flatten_fragment(self._fragment_params(p)))
        overwrite = []
        pulled = {}
        for p in range(self.layout.num_fragments):
            version, value = self.link.pull(p)
            self.bytes_down += value.numel() * 4
            pulled[p] = version
            if resume is not None and resume["versions"][p] == version:
                continue  # nothing merged since our checkpoint: keep local progress
            self.bases[p] = value
            overwrite.append(p)
        return {"versions": pulled, "overwrite": overwrite}

    # ---- the inner-step hook ------------------------------------------------------------------

    def after_step(self, tokens: float) -> None:
        """Call after every inner optimizer step with the tokens this rank consumed in it."""
        started = time.perf_counter()
        if self._last_step_at is not None:
            dt = started - self._last_step_at
            self._step_time = dt if not self._step_time else 0.9 * self._step_time + 0.1 * dt
        self.step += 1
        island_tokens = tokens * self.collective.world_size  # ranks see equal shards
        for p in range(self.layout.num_fragments):
            self.tokens[p] += island_tokens
            self.steps[p] += 1
        due = due_fragment(self.step, self.offsets, self.config.schedule.sync_every)
        if due is not None:
            if due in self.in_flight:
                self.counters["skipped"] += 1  # never two sends of one fragment in flight
            else:
                self._send(due)
        if self.in_flight:
            self._apply_arrived()
        self._last_step_at = time.perf_counter()
        self.blocked_s += self._last_step_at - started

    def _send(self, p: int) -> None:
        snapshot = flatten_fragment(self._fragment_params(p))  # host copy, 1/P of the model
        keep = snapshot if self.config.schedule.apply == "rebase" else None
        future = None
        if self.is_leader:
            self.seq += 1
            future = self._executor.submit(
                self._exchange, p, snapshot, self.versions[p], self.bases[p], self.tokens[p], self.steps[p], self.seq
            )
        self.in_flight[p] = _Flight(p, self.step + self.config.schedule.overlap_steps, keep, self.tokens[p], self.steps[p], future)
        self.counters["sent"] += 1

    def _exchange(self, p, snapshot, base_version, base, tokens, steps, seq) -> tuple[int, torch.Tensor]:
        """Background: push the delta and return (new version, new global value)."""
        from lightning_diloco.transport.client import SynchronizerError

        payload = self.uplink.encode(snapshot - base)
        self.bytes_up += payload.numel()
        try:
            reply = self.link.push(
                island=self.island, fragment=p, base_version=base_version, tokens=max(tokens, 1.0), steps=max(steps, 1),
                codec=self.uplink.name, seq=seq, payload=payload, layout_hash=self.layout.hash, wait=self.push_wait,
            )
        except SynchronizerError as err:
            if err.reason not in REPULL_REASONS:
                raise
            log.info("island %d: fragment %d %s; pulling the current global value", self.island, p, err.reason)
            self.counters["repulled"] += 1
            version, value = self.link.pull(p)
            self.bytes_down += value.numel() * 4
            return version, value
        self.bytes_down += len(reply.payload)
        update = get_codec(reply.codec, self.config.codec.block_size).decode(reply.payload, snapshot.numel())
        return reply.version, base + update

    def _apply_arrived(self) -> None:
        due = sorted(p for p, f in self.in_flight.items() if f.apply_at <= self.step)
        if not due:
            return
        ready = None
        if self.is_leader:
            wait = self.config.schedule.overlap_steps == 0  # synchronous DiLoCo waits for the reply
            ready = [p for p in due if wait or self.in_flight[p].future.done()]
        ready = self.collective.broadcast_object(ready) if self.collective.world_size > 1 else ready
        for p in ready:
            flight = self.in_flight.pop(p)
            outcome = self._outcome(flight) if self.is_leader else None
            if self.collective.world_size > 1:
                outcome = self.collective.broadcast_object(None if outcome is None else outcome[0])
                if outcome is not None:
                    value = self.bases[p] if self.is_leader else torch.empty(self.layout.fragment_numel(p))
                    outcome = (outcome, self.collective.broadcast_tensor(value))
            if outcome is not None:
                self._apply(flight, *outcome)

    def _outcome(self, flight: _Flight) -> tuple[int, torch.Tensor] | None:
        try:
            version, value = flight.future.result()
        except Exception as err:  # the synchronizer is away or refused: train on, resend next time
            self.counters["failed"] += 1
            self.reachable = False
            log.warning("island %d: sync of fragment %d failed: %s", self.island, flight.fragment, err)
            return None
        self.reachable = True
        self.bases[flight.fragment] = value  # broadcast from here to the other ranks
        return version, value

    def _apply(self, flight: _Flight, version: int, value: torch.Tensor) -> None:
        p, sched = flight.fragment, self.config.schedule
        if sched.apply == "overwrite":
            target = value
        else:
            current = flatten_fragment(self._fragment_params(p))
            if sched.apply == "mix":
                target = current.mul_(sched.mix_alpha).add_(value, alpha=1.0 - sched.mix_alpha)
            else:  # rebase: keep the progress made since the snapshot
                target = current.sub_(flight.snapshot).add_(value)
        self.write_fragment(p, target)
        self.staleness = max(0, version - self.versions[p] - 1)
        self.bases[p], self.versions[p] = value, version
        if sched.apply == "rebase":
            self.tokens[p] -= flight.tokens_at_send
            self.steps[p] -= flight.steps_at_send
        else:
            self.tokens[p], self.steps[p] = 0.0, 0
        self.counters["applied"] += 1

    @torch.no_grad()
    def write_fragment(self, p: int, flat: torch.Tensor) -> None:
        specs = self.layout.fragment_specs(p)
        for param, value in zip(self._fragment_params(p), split_fragment(flat, specs)):
            param.copy_(value)

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """The last received global fragments in place of the local weights, put back on exit."""
        saved = [p.detach().clone() for p in self.params]
        try:
            for p in range(self.layout.num_fragments):
                self.write_fragment(p, self.bases[p])
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(self.params, saved):
                    param.copy_(value)

    # ---- the end ------------------------------------------------------------------------------

    def finish(self, timeout: float = 30.0) -> None:
        """Wait for what is in flight, then load the current global model on every rank."""
        plan = None
        if self.is_leader:
            deadline = time.monotonic() + timeout
            for flight in self.in_flight.values():
                try:
                    flight.future.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception as err:  # noqa: BLE001 - reported; the pull below decides
                    log.warning("island %d: last sync of fragment %d did not complete: %s", self.island, flight.fragment, err)
            try:
                plan = {}
                for p in range(self.layout.num_fragments):
                    version, self.bases[p] = self.link.pull(p)
                    plan[p] = version
            except Exception as err:  # keep the local model rather than crash at the very end
                log.warning("island %d: could not pull the final global model: %s", self.island, err)
                plan = None
        self.in_flight.clear()
        plan = self.collective.broadcast_object(plan) if self.collective.world_size > 1 else plan
        if plan is None:
            return
        for p, version in plan.items():
            value = self.bases[p] if self.is_leader else torch.empty(self.layout.fragment_numel(p))
            self.bases[p] = self.collective.broadcast_tensor(value) if self.collective.world_size > 1 else value
            self.versions[p] = version
            self.write_fragment(p, self.bases[p])

    def close(self) -> None:
        self._stop.set()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.link is not None:
            self.link.close()  # cancels pushes still waiting on a round
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.link.heartbeat(self.island, self.step, self._step_time)
                self.reachable = True
            except Exception as err:  # noqa: BLE001 - liveness only; pushes report real failures
                self.reachable = False
                log.debug("island %d: heartbeat failed: %s", self.island, err)

    # ---- state and metrics --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Outer state for Lightning checkpoints: plain tensors and numbers (weights_only-safe)."""
        return {
            "format": STATE_FORMAT,
            "layout_hash": self.layout.hash,
            "step": self.step,
            "versions": list(self.versions),
            "bases": [b.clone() for b in self.bases],
            "tokens": list(self.tokens),
            "steps": list(self.steps),
            "seq": self.seq,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT or state.get("layout_hash") != self.layout.hash:
            raise ValueError(
                f"the checkpoint's DiLoCo state (format {state.get('format')}, layout {state.get('layout_hash')}) does not "
                f"match this model (layout {self.layout.hash}); resume with the same model and num_fragments"
            )
        self.step = int(state["step"])
        self.versions = [int(v) for v in state["versions"]]
        self.bases = [b.clone() for b in state["bases"]]
        self.tokens = [float(t) for t in state["tokens"]]
        self.steps = [int(s) for s in state["steps"]]
        self.seq = max(self.seq, int(state["seq"]))

    def metrics(self) -> dict[str, float]:
        out = {f"diloco/syncs_{k}": float(v) for k, v in self.counters.items()}
        out.update({
            "diloco/bytes_up": float(self.bytes_up),
            "diloco/bytes_down": float(self.bytes_down),
            "diloco/blocked_s": self.blocked_s,
            "diloco/staleness": float(self.staleness),
            "diloco/in_flight": float(len(self.in_flight)),
            "diloco/min_version": float(min(self.versions)),
            "diloco/synchronizer_reachable": float(self.reachable),
        })
        return out
