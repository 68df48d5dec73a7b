"""Background threads beside a training loop add no OpenMP teams (the cause of a 1.3x step time)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lightning_diloco.core.threads import single_threaded_torch, torch_on_this_thread

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")


def _threads_added_by_a_parallel_op(limit: bool) -> tuple[int, int]:
    """(OS threads the op added, torch threads seen) on a helper thread that stays alive."""
    seen: dict[str, int] = {}

    def work() -> None:
        if limit:
            assert single_threaded_torch()
        before = set(os.listdir("/proc/self/task"))
        assert float((torch.ones(4_000_000) * 2).sum()) == 8_000_000  # big enough to run in parallel
        seen["added"] = len(set(os.listdir("/proc/self/task")) - before)  # threads of earlier tests may end meanwhile
        seen["torch"] = torch.get_num_threads()

    helper = threading.Thread(target=work)
    helper.start()
    helper.join()
    return seen["added"], seen["torch"]


def test_a_limited_helper_thread_runs_torch_without_a_team_of_its_own(two_torch_threads):
    added, torch_threads = _threads_added_by_a_parallel_op(limit=False)
    assert added >= 1 and torch_threads == 2  # the control: an unlimited helper grows a team
    # another test's leftover thread may start meanwhile: one clean try of three is enough
    tries = [_threads_added_by_a_parallel_op(limit=True) for _ in range(3)]
    assert min(added for added, _ in tries) == 0 and all(torch_threads == 1 for _, torch_threads in tries)
    assert torch.get_num_threads() == 2  # the calling (training) thread keeps its team


def test_the_synchronizer_pool_runs_torch_single_threaded(two_torch_threads):
    from lightning_diloco.core.config import RunConfig, ScheduleConfig
    from lightning_diloco.synchronizer.server import SynchronizerServer
    from lightning_diloco.synchronizer.service import Synchronizer

    server = SynchronizerServer(Synchronizer(RunConfig(schedule=ScheduleConfig(num_fragments=1, sync_every=4))))
    try:
        assert server.executor.submit(torch.get_num_threads).result() == 1
    finally:
        server.stop(grace=0)
    assert torch.get_num_threads() == 2


def test_the_training_thread_runs_a_step_boundary_alone_and_gets_its_team_back(two_torch_threads):
    with torch_on_this_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), torch_on_this_thread():
        raise RuntimeError("a failing step boundary")
    assert torch.get_num_threads() == 2  # given back on the way out of an error too
