"""How the leader of a multi-process island shares its decisions with the other ranks."""

from __future__ import annotations

import torch


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


def leave_process_group(timeout_s: float = 120.0) -> None:
    """End of a multi-process island's script: every rank leaves the process group together.

    Lightning leaves the group up after ``fit`` (a second fit or an evaluation may use it). A rank
    that then exits while its peer's gloo threads still read from it was seen to abort at exit
    ("terminate called without an active exception", exit -6) under load. A rank whose peers never
    arrive (they crashed) gives up after ``timeout_s`` and exits anyway.
    """
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # a peer is gone: nothing to leave together with
        pass
    dist.destroy_process_group()
