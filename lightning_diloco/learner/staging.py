"""Moving fragments between the device the parameters live on and host memory, off the training stream.

An island reads a fragment (its snapshot, for a send) and writes one (an applied global
fragment) at step boundaries. On the CPU these are plain copies. On CUDA a plain ``.cpu()`` would
make the training thread wait until the GPU had run every kernel queued before it, so:

- **Down** (:meth:`HostStaging.snapshot`): the fragment's tensors are packed into one flat
  device buffer on the training stream (a device-to-device copy, queued, at most the largest
  fragment of extra GPU memory), then a side stream, after waiting for the training stream up to
  that point, copies it with ``non_blocking=True`` into pinned host memory and records an event.
  The training thread goes on at once; the push thread calls :meth:`HostCopy.wait` (the event's
  ``synchronize``) before it reads the host tensor, and never sees a CUDA tensor.
- **Up** (:meth:`HostStaging.upload`): a host fragment is copied into pinned memory, sent to the
  device on the side stream, and the training stream waits for that copy's event (on the GPU,
  not the host) before the parameters are written from it.

Pinned buffers come from torch's caching host allocator: a buffer is reused only once its copy's
event has completed and no tensor refers to it, so a push still holding an earlier snapshot of a
fragment is never overwritten. Everything here except the two branches marked CUDA runs on the
CPU too, where a snapshot is ready when it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lightning_diloco.core.fragments import flatten_fragment


class _Done(Protocol):
    """What a copy's completion is signalled by (``torch.cuda.Event`` on CUDA)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class HostCopy:
    """A flat host tensor, possibly still being filled by a device-to-host copy."""

    def __init__(self, host: torch.Tensor, done: _Done | None = None) -> None:
        """``done``: signalled when the copy into ``host`` has finished; None: it has."""
        assert host.device.type == "cpu", f"a host copy lives in host memory, not on {host.device}"
        self._host, self._done = host, done

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once its copy has finished (blocks the calling thread until then)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host


class HostStaging:
    """Fragment copies between ``device`` and the host, in host ``dtype`` (fp32: the bases,
    snapshots and global fragments the island keeps are fp32, whatever the parameters' dtype)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        """The side stream of the copies on CUDA; None elsewhere, where a copy is done when made."""

    @torch.no_grad()
    def snapshot(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """A flat host copy of ``tensors`` (all on ``device``) as they are at this point of the
        training stream; later changes to them do not reach it."""
        n, stream = sum(t.numel() for t in tensors), self._stream
        if stream is None:
            return HostCopy(flatten_fragment(tensors).to(self.dtype))
        # CUDA: pack on the training stream (queued behind the step that produced the values)
        packed = torch.empty(n, dtype=self.dtype, device=self.device)
        start = 0
        for t in tensors:
            packed[start : start + t.numel()].copy_(t.detach().reshape(-1))
            start += t.numel()
        host = torch.empty(n, dtype=self.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        packed.record_stream(stream)  # not reused by the training stream until the copy has read it
        return HostCopy(host, done)

    @torch.no_grad()
    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (host) on ``device``, ready for the training stream's next kernels; ``flat``
        itself on the CPU."""
        if self._stream is None:
            return flat
        # CUDA: host -> pinned (a host copy), pinned -> device on the side stream; the training
        # stream waits for it on the GPU, the host does not
        pinned = torch.empty(flat.numel(), dtype=self.dtype, pin_memory=True)
        pinned.copy_(flat)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            on_device = pinned.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        current.wait_event(done)
        on_device.record_stream(current)  # allocated on the side stream, used on the training stream
        return on_device
