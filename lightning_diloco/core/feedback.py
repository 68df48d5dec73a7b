"""Error feedback on the uplink: what the codec could not carry of an island's progress goes out
with its next push of the same fragment.

A lossy uplink codec sends encode(delta) for an island's progress delta; the synchronizer merges
decode(encode(delta)), and the difference is lost: over many rounds each fragment's outer
gradients are off by an error of the codec's size every time, never made up. With feedback the
island keeps that difference (the residual, one fp32 copy of each fragment on the island's
leader) and adds it to the next delta of the fragment before encoding:

    sent_n = encode(delta_n + residual_{n-1}),    residual_n = delta_n + residual_{n-1} - decode(sent_n)

so the sum of what the synchronizer received tracks the sum of the island's progress within one
message's error, however many rounds pass (tests/core/test_feedback.py). This is what lets
int2 (a relative error of about 0.34 per message) train. The sparse codec (0.95 at density 1/64:
the residual holds what the chunks' top-k left out until it is among the largest) needs it too,
and there the residual is a backlog: where the islands' progress is less concentrated than a
top-k carries, it grows while the learning rate is high (150x int4's at 1/16) and the global
model trails (benchmarks/RESULTS.md, 2026-11-29). The downlink has its own, on the
synchronizer's side (core/downlink.py).

With ``uplink_residual="parameters"`` the island takes the residual out (:meth:`UplinkFeedback.take`)
when it applies the version its push went into and adds it to its parameters
(learner/fragment.py): its next progress then includes it, and the next push carries it once. Held
here instead while the island is reset to the global value, it is counted twice: the island
re-learns what it did not send, and the residual still holds it. With the sparse codec, whose
residual holds most of each push, that trained better (docs/algorithm.md), once the tensors a
top-k cannot carry go densely: a residual that is never sent stays in each island's parameters
and the islands drift apart. A residual the island did not take (its push failed, or no version
ended its flight) goes with the next push as before.

The residual is formed when a push is encoded, whether or not the push then arrives: a push the
synchronizer refused or never saw loses its delta, as it would without feedback (adding it again
could count it twice when only the acknowledgement was lost). It lives in the island's memory
only: a restarted island starts without one.
"""

from __future__ import annotations

import threading

import torch

from lightning_diloco.core.codecs import Codec


class UplinkFeedback:
    """Encode each fragment's progress with ``codec``, carrying the residual of its last push.

    Thread-safe: pushes run on a pool, and two pushes of one fragment (a slow one still encoding
    when the next is due) take the fragment's residual one after the other.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._lock = threading.Lock()
        self._fragment_locks: dict[int, threading.Lock] = {}
        self.residual: dict[int, torch.Tensor] = {}

    def encode(self, fragment: int, delta: torch.Tensor, codec: Codec | None = None) -> torch.Tensor:
        """The payload for ``delta`` (flat fp32 progress of ``fragment``, not changed), in
        ``codec`` where given (a fragment the uplink sends in another codec), else the uplink's."""
        codec = codec or self.codec
        with self._lock:
            lock = self._fragment_locks.setdefault(fragment, threading.Lock())
        with lock:
            residual = self.residual.get(fragment)
            if residual is not None and residual.numel() == delta.numel():
                target = delta.reshape(-1) + residual
            else:  # the first push of the fragment (or a fragment of a new layout)
                target = delta.reshape(-1).to(torch.float32, copy=True)
            payload = codec.encode(target)
            self.residual[fragment] = target.sub_(codec.decode(payload, target.numel()))
            return payload

    def take(self, fragment: int) -> torch.Tensor | None:
        """Remove and return ``fragment``'s residual (None: none held), for the island to keep in
        its parameters; the next push of the fragment adds none."""
        with self._lock:
            lock = self._fragment_locks.setdefault(fragment, threading.Lock())
        with lock:
            return self.residual.pop(fragment, None)
