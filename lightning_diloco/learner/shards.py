"""This rank's part of each fragment, and the moves between it and the whole fragment.

The layout and the synchronizer see whole tensors (their global names and shapes), so islands of
any inner parallelism join one run. Inside an island a parameter is either a plain tensor, whole
on every rank (one process, DDP), or a ``DTensor`` of which a rank holds its local shard (FSDP2's
``fully_shard``; tensor parallelism and HSDP give DTensors too, with other placements). The
island keeps and updates only local parts, elementwise (bases, snapshots, applies); whole
fragments exist only in flight, one fragment at a time:

- :meth:`IslandShards.gather` assembles a fragment's whole value on the leader for a send,
  tensor by tensor (``DTensor.full_tensor()``: every rank holds one whole tensor at a time).
- :meth:`IslandShards.scatter` takes the leader's whole fragment to every rank's local part
  (a broadcast of the fragment, then each rank cuts its shard out with the parameter's own
  placements, with no further communication).

A sync's extra memory per rank is therefore: the local bases (1/W of the model, fp32, host), and
in flight one whole fragment (fp32, host; at most the largest, about 1/P of the model) plus one
whole tensor on the device. The leader also keeps the global model whole in host memory, in its
inbox: the downlink sends deltas against it (``benchmarks/fsdp_overhead.py`` measures both).

Reads and writes of a local part go through :class:`~lightning_diloco.learner.staging.HostStaging`:
on CUDA off the training stream, through one flat fp32 fragment on the device (at most the
largest); :meth:`IslandShards.apply` takes a global fragment into the parameters where they live,
without reading them back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from lightning_diloco.core.apply import apply_global, reads_local, reads_reference
from lightning_diloco.core.fragments import FragmentLayout
from lightning_diloco.learner.collective import Collective
from lightning_diloco.learner.staging import HostCopy, HostStaging

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # a torch without DTensor has no sharded parameters either
    DTensor, distribute_tensor = (), None  # type: ignore[misc,assignment]  # isinstance(t, ()) is False; never called


def _is_sharded(t: torch.Tensor) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_sharded(t) else t


class IslandShards:
    def __init__(self, params: Sequence[torch.Tensor], layout: FragmentLayout, collective: Collective, *, leader: bool) -> None:
        """``params``: the model's trainable tensors in ``layout.specs`` order, plain or DTensors."""
        for param, spec in zip(params, layout.specs):
            if tuple(param.shape) != spec.shape:  # a DTensor's shape is the global one
                raise ValueError(f"parameter {spec.name!r} has shape {tuple(param.shape)}, the layout {spec.shape}")
        self.params, self.layout, self.collective, self.leader = list(params), layout, collective, leader
        self.sharded = [_is_sharded(t) for t in self.params]
        self.staging = HostStaging(_local(self.params[0]).device if self.params else torch.device("cpu"))
        self.before_write: Callable[[], None] | None = None
        """Set by a strategy whose modules may hold gathered copies of the shards (FSDP2 keeps the
        root's after a forward without backward): drops them, so the next forward sees the write."""

    def _members(self, p: int) -> list[int]:
        return list(self.layout.fragments[p])

    def any_sharded(self, p: int) -> bool:
        return any(self.sharded[i] for i in self._members(p))

    def local_numel(self, p: int) -> int:
        return sum(_local(self.params[i]).numel() for i in self._members(p))

    def snapshot(self, p: int) -> HostCopy:
        """This rank's part of fragment ``p`` as it is now: a flat fp32 host copy, on CUDA still
        being copied (:meth:`HostCopy.wait <lightning_diloco.learner.staging.HostCopy.wait>`)."""
        return self.staging.snapshot([_local(self.params[i]) for i in self._members(p)])

    def read(self, p: int) -> torch.Tensor:
        """This rank's part of fragment ``p``: a flat fp32 host copy (waits for it on CUDA)."""
        return self.snapshot(p).wait()

    @torch.no_grad()
    def write(self, p: int, flat: torch.Tensor) -> None:
        """Put ``flat`` (this rank's part, as :meth:`read` gives it) into the parameters."""
        for local, piece in self._pieces(p, flat):
            local.copy_(piece)

    @torch.no_grad()
    def add(self, p: int, flat: torch.Tensor) -> None:
        """Add ``flat`` (this rank's part, as :meth:`read` gives it) to the parameters."""
        for local, piece in self._pieces(p, flat):
            local.add_(piece)

    def _pieces(self, p: int, flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(this rank's part of each tensor of fragment ``p``, its piece of ``flat`` uploaded), to write into."""
        if self.before_write is not None:
            self.before_write()
        flat = self.staging.upload(flat)
        start = 0
        for i in self._members(p):
            local = _local(self.params[i])
            yield local, flat[start : start + local.numel()].view(local.shape)
            start += local.numel()
        assert start == flat.numel(), f"{flat.numel()=} != {start=}"

    @torch.no_grad()
    def apply(self, p: int, mode: str, new_global: torch.Tensor, reference: torch.Tensor | None, *, alpha: float,
              keep: float = 1.0) -> None:
        """Take the global fragment ``new_global`` into this rank's part of fragment ``p`` with apply
        ``mode`` (:func:`~lightning_diloco.core.apply.apply_global`; ``reference`` as there; all
        flat fp32 host tensors of this rank's part), tensor by tensor where the parameters live."""
        if self.before_write is not None:
            self.before_write()
        new_global = self.staging.upload(new_global)
        # rebase reads the reference (apply_global refuses a missing one); the other modes do not
        reference = self.staging.upload(reference) if reference is not None and reads_reference(mode) else None
        start = 0
        for i in self._members(p):
            local = _local(self.params[i])
            end = start + local.numel()
            current = local.to(self.staging.dtype) if reads_local(mode) else None  # fp32 parameters: themselves
            out = apply_global(mode, current, new_global[start:end].view(local.shape),
                               None if reference is None else reference[start:end].view(local.shape), alpha=alpha, keep=keep)
            if out is not local:
                local.copy_(out)
            start = end
        assert start == new_global.numel(), f"{new_global.numel()=} != {start=}"

    def save(self) -> list[torch.Tensor]:
        """A copy of this rank's part of every parameter, in its own dtype (for :meth:`restore`)."""
        return [_local(t).detach().clone() for t in self.params]

    @torch.no_grad()
    def restore(self, saved: list[torch.Tensor]) -> None:
        if self.before_write is not None:
            self.before_write()
        for param, value in zip(self.params, saved):
            _local(param).copy_(value)

    def local_pieces(self, p: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (this rank's part of fragment ``p``) shaped like each tensor's local part."""
        out, start = [], 0
        for i in self._members(p):
            local = _local(self.params[i])
            out.append(flat[start : start + local.numel()].view(local.shape))
            start += local.numel()
        return out

    @torch.no_grad()
    def local_part(self, i: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of tensor ``i`` (in ``layout.specs`` order) given its whole value."""
        param = self.params[i]
        if not self.sharded[i]:
            return whole
        return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None).to_local().cpu()

    def as_distributed(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's part of tensor ``i``) as a DTensor placed like the parameter;
        ``local`` itself for a plain parameter."""
        param = self.params[i]
        if not self.sharded[i]:
            return local
        return DTensor.from_local(local.to(param.to_local().device), param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())

    @torch.no_grad()
    def gather(self, p: int, flat: torch.Tensor) -> torch.Tensor | None:
        """The whole fragment whose local parts are ``flat`` on each rank: on the leader, None
        elsewhere. Every rank must call it (sharded tensors are all-gathered, one at a time)."""
        if not self.any_sharded(p):
            return flat if self.leader else None  # every rank holds it whole already
        pieces, start = [], 0
        for i in self._members(p):
            param = self.params[i]
            local = _local(param)
            piece = flat[start : start + local.numel()].view(local.shape)
            start += local.numel()
            if self.sharded[i]:
                whole = DTensor.from_local(piece.to(local.device), param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride()).full_tensor()
                piece = whole.reshape(-1).to("cpu", torch.float32)
            if self.leader:
                pieces.append(piece.reshape(-1))
        return torch.cat(pieces) if self.leader else None

    @torch.no_grad()
    def scatter(self, p: int, whole: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of the leader's whole fragment ``p`` (the other ranks pass None)."""
        whole = self.collective.broadcast_tensor(torch.empty(self.layout.fragment_numel(p)) if whole is None else whole)
        if not self.any_sharded(p):
            return whole
        parts, start = [], 0
        for i, spec in zip(self._members(p), self.layout.fragment_specs(p)):
            value = whole[start : start + spec.numel].view(spec.shape)
            start += spec.numel
            param = self.params[i]
            if self.sharded[i]:  # src_data_rank=None: each rank cuts its own shard, no communication
                value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                          src_data_rank=None).to_local()
            parts.append(value.reshape(-1).to("cpu", torch.float32))
        return torch.cat(parts) if parts else whole[:0]
