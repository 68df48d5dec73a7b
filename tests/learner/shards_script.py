"""Run by test_shards.py under `torchrun --standalone --nproc-per-node 2`: IslandShards over FSDP2
parameters (uneven and empty shards, a root module owning parameters), on gloo."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402

from lightning_diloco.core.fragments import build_layout, split_fragment, tensor_specs  # noqa: E402
from lightning_diloco.learner.collective import TorchCollective  # noqa: E402
from lightning_diloco.learner.shards import IslandShards  # noqa: E402
from tests.helpers import exit_now  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # 5 rows over 2 ranks: 3 and 2; the head's 1 row: 1 and 0. The head stays with the root module
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))
    plain = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))
    plain.load_state_dict(model.state_dict())
    specs = tensor_specs(plain)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert tensor_specs(model) == specs, "the layout sees the whole shapes and names"
    layout = build_layout(specs, 2)
    named = dict(model.named_parameters())
    shards = IslandShards([named[s.name] for s in specs], layout, TorchCollective(2, torch.device("cpu")), leader=rank == 0)
    x = torch.randn(4, 8)

    for p in range(layout.num_fragments):
        local = shards.read(p)
        assert local.numel() == shards.local_numel(p) < layout.fragment_numel(p)  # no rank holds it whole
        whole = shards.gather(p, local)
        expected = torch.cat([dict(plain.named_parameters())[s.name].detach().reshape(-1) for s in layout.fragment_specs(p)])
        assert (whole is None) == (rank != 0) and (rank != 0 or torch.equal(whole, expected)), p
        # the leader's whole value reaches every rank's shard
        new = expected + 1.0 + p
        shards.write(p, shards.scatter(p, new if rank == 0 else None))
        with torch.no_grad():
            for param, value in zip((dict(plain.named_parameters())[s.name] for s in layout.fragment_specs(p)),
                                    split_fragment(new, layout.fragment_specs(p))):
                param.copy_(value)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))  # an evaluation: FSDP2 keeps the root's gathered after it
        for p in range(layout.num_fragments):
            shards.write(p, shards.read(p) * 2)
            for param in (dict(plain.named_parameters())[s.name] for s in layout.fragment_specs(p)):
                param.mul_(2)
        stale = not torch.allclose(model(x), plain(x))  # the head's write did not reach the gathered copy
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        shards.before_write = lambda: [m.reshard() for m in model.modules() if isinstance(m, FSDPModule)]
        model(x)  # gathers the root's again
        for p in range(layout.num_fragments):  # the hook reshards before each write
            shards.write(p, shards.read(p) * 3)
            for param in (dict(plain.named_parameters())[s.name] for s in layout.fragment_specs(p)):
                param.mul_(3)
        torch.testing.assert_close(model(x), plain(x))
    print(f"rank {rank} ok stale_without_reshard={stale}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()
