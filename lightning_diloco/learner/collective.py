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
