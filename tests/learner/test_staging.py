"""Fragment copies between the parameters' device and the host (learner/staging.py), on the CPU:
the ordering contract of a snapshot still being copied, and applies made where the parameters live."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from lightning_diloco.core.apply import apply_global
from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import build_layout
from lightning_diloco.learner.collective import Collective
from lightning_diloco.learner.leader import LeaderSync, sync_pool
from lightning_diloco.learner.shards import IslandShards
from lightning_diloco.learner.staging import HostCopy, HostStaging
from tests.helpers import SPECS

WAIT_S = 120  # hang guard only


class ManualEvent:
    """Stands in for the CUDA event of a device-to-host copy: done when the test says so."""

    def __init__(self) -> None:
        self._set = threading.Event()

    def finish(self) -> None:
        self._set.set()

    def query(self) -> bool:
        return self._set.is_set()

    def synchronize(self) -> None:
        assert self._set.wait(WAIT_S), "the copy was never signalled done"


class RecordingLink:
    """A synchronizer link that records what each push carried."""

    def __init__(self) -> None:
        self.pushed: list[torch.Tensor] = []

    def push(self, contribution):
        self.pushed.append(contribution.payload.clone())
        return SimpleNamespace(late=False, round=contribution.round)


def test_a_snapshot_is_a_host_copy_in_the_target_dtype_that_later_steps_do_not_change():
    params = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16)]
    copy = HostStaging(torch.device("cpu")).snapshot(params)
    expected = torch.cat([p.float().reshape(-1) for p in params])
    for p in params:
        p.add_(1.0)  # the next optimizer step
    host = copy.wait()
    assert host.device.type == "cpu" and host.dtype == torch.float32
    assert torch.equal(host, expected)


def test_a_host_copy_refuses_a_tensor_not_in_host_memory():
    with pytest.raises(AssertionError, match="host memory"):
        HostCopy(torch.empty(4, device="meta"))


def test_the_push_thread_reads_a_snapshot_only_after_its_copy_is_signalled_done():
    link = RecordingLink()
    leader = LeaderSync(link, island=0, uplink=get_codec("fp32", 256), feedback=False, layout_hash="h",
                        executor=sync_pool(0, 1), progress=lambda: (0, 0.0, 0))
    try:
        host, base = torch.full((8,), 3.0), torch.ones(8)
        done = ManualEvent()
        future = leader.push(fragment=0, round=0, local=HostCopy(host, done), base=base, base_version=0, tokens=1.0,
                             steps=1, seq=1)
        # the pool thread is waiting on the copy: nothing pushed, however long we look
        assert not done.query() and not future.done() and link.pushed == []
        done.finish()
        assert future.result(timeout=WAIT_S).round == 0
        assert len(link.pushed) == 1
        assert torch.equal(get_codec("fp32", 256).decode(link.pushed[0], 8), host - base)
    finally:
        leader.executor.shutdown(wait=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["overwrite", "mix", "rebase"])
def test_an_apply_in_place_matches_the_host_rule(mode, dtype):
    layout = build_layout(SPECS, 2)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s.shape, generator=g).to(dtype) for s in SPECS]
    shards = IslandShards(params, layout, Collective(), leader=True)
    p = 1
    local = shards.read(p)
    new_global, reference = torch.randn(local.numel(), generator=g), torch.randn(local.numel(), generator=g)
    expected = apply_global(mode, local.clone(), new_global, reference, alpha=0.3)
    shards.apply(p, mode, new_global, reference, alpha=0.3)
    # what the parameters hold now: the host rule's result in their own dtype
    assert torch.equal(shards.read(p), expected.to(dtype).float())


def test_an_upload_on_the_cpu_is_the_tensor_itself():
    flat = torch.randn(6)
    assert HostStaging(torch.device("cpu")).upload(flat) is flat
