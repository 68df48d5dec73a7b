"""The refusal that answers a bad request (what a push is refused by, and in what order:
push_admission.py), how refusals are said in the log and counted (:class:`Tally`), and what a
retry's payload and an island's layout are compared by. A contribution itself is a
core/protocol.py record.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter

import torch

from lightning_diloco.core.codecs import Payload, payload_size
from lightning_diloco.core.fragments import FragmentLayout
from lightning_diloco.reasons import Reason

log = logging.getLogger(__name__)


class Refusal(Exception):
    """A request the synchronizer will not act on. The global state is untouched.

    ``reason`` is counted in Status; the message says what was wrong and how to fix it.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RefusalLog:
    """Which refusals to say in the log: each reason's first, then at most one per ``every``
    seconds, with how many were left out since (Status counts every one). A client refused in a
    loop, which needs no token, wrote a line per call: 3,700 a second, 620 kB/s of log from one
    client here, a disk filled in hours."""

    def __init__(self, every: float = 10.0, clock=time.monotonic) -> None:
        self.every, self.clock = every, clock
        self.lock = threading.Lock()
        self.said_at: dict[str, float] = {}
        self.left_out: dict[str, int] = {}

    def due(self, reason: str) -> int | None:
        """None: leave this one out; else say it, with the number left out before it."""
        with self.lock:
            now, said = self.clock(), self.said_at.get(reason)
            if said is not None and now - said < self.every:
                self.left_out[reason] = self.left_out.get(reason, 0) + 1
                return None
            self.said_at[reason] = now
            return self.left_out.pop(reason, 0)


class Tally:
    """What Status counts of a synchronizer's requests: those accepted (by kind), those refused
    (by reason), and the payload bytes in and out. ``lock`` is a leaf: nothing is taken under it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accepted: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.bytes_in = self.bytes_out = 0
        self.refusal_log = RefusalLog()

    def refuse(self, reason: Reason, message: str) -> Refusal:
        """Count a refusal for ``reason``, say it in the log (:class:`RefusalLog`) and return it to raise."""
        with self.lock:
            self.refused[reason.value] += 1
        left_out = self.refusal_log.due(reason.value)
        if left_out is not None:
            more = f" ({left_out} more refused for this reason since its last line, not logged)" if left_out else ""
            log.warning("refused (%s): %s%s", reason, message, more)
        return Refusal(reason, message)

    def accept(self, kind: str) -> None:
        with self.lock:
            self.accepted[kind] += 1

    def count_closed(self, merged: int, dropped: int) -> None:
        """A closed round's entries: those merged, and those left out because the step with them
        was not finite (refused, and not said in the log: the closer says it)."""
        with self.lock:
            self.accepted["merged"] += merged
            if dropped:
                self.refused[Reason.NON_FINITE_STEP.value] += dropped

    def add_bytes(self, *, received: int = 0, sent: int = 0) -> None:
        with self.lock:
            self.bytes_in += received
            self.bytes_out += sent


def payload_digest(payload: Payload) -> bytes:
    """What a retry's payload is compared with: its size and CRC-32, over the bytes in place.

    A checksum, not a cryptographic digest, on purpose: it is only ever compared with an earlier
    push of the same island, session, fragment and sequence number, and a payload made to collide
    is answered as a retry and not merged, so a forger only drops its own work. What it is there
    for, a client that reuses a sequence number for new work by mistake, it catches but for one
    case in 2**32. CRC-32 reads 7 GB/s here, blake2b 1.45 and SHA-256 2.1: the digest was the
    largest single cost of a push (benchmarks/RESULTS.md).
    """
    data = payload.numpy() if isinstance(payload, torch.Tensor) else payload
    return payload_size(payload).to_bytes(8, "little") + zlib.crc32(data).to_bytes(4, "little")  # type: ignore[arg-type]  # a buffer; numpy says so for Python 3.12+ only


def layout_difference(run: FragmentLayout, other: FragmentLayout) -> str:
    if run.specs == other.specs:
        return (f"same model, but the run packs it into num_fragments={run.num_fragments} and this island into "
                f"{other.num_fragments}; use the run's num_fragments")
    for mine, theirs in zip(run.specs, other.specs):
        if mine != theirs:
            return f"model layout differs from the run's at tensor {mine.name!r}: run has {mine}, island has {theirs}; every island must train the same model"
    return (
        f"model layout differs from the run's: run has {len(run.specs)} tensors, island has {len(other.specs)}; "
        "every island must train the same model"
    )
