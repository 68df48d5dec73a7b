"""Police fixtures: a test that leaks a thread, a child process, a listening port or a
temporary file fails."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # CI has 2 cores; subprocesses under test get the other one


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _listening_ports() -> set[int]:
    """TCP ports this process listens on: its socket inodes matched against /proc/net/tcp*."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# process-wide caches made once, by whichever test first needs them, not leaks of that test:
# pytest's tmp_path root and torch's compile cache (created on torch._dynamo's first import)
_SESSION_CACHES = ("pytest-of-", "torchinductor_")
# and threads libraries start once per process and keep: tqdm's progress-bar monitor
_SESSION_THREADS = ("tqdm_monitor",)


def _temporary_files() -> set[str]:
    """Entries in the session's private temporary directory, other than the session caches."""
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if not p.name.startswith(_SESSION_CACHES)}


_PRIVATE_TMP = pytest.StashKey[str]()


# tests that set up network namespaces, veth pairs and a bridge with fixed names and addresses
# (benchmarks/netns.py, tests/deploy/hosts.py): one xdist worker runs them, one after the other
_FIXED_NETWORKS = ("tests/deploy/", "tests/benchmarks/test_network_benchmarks.py", "tests/integration/test_container.py")


# end-to-end runs of a benchmark or a recipe at toy size, a minute or more each on this machine:
# the `long` tier, out of the default run (pyproject addopts) so that the suite fits CI's 25
# minutes; `bash scripts/test.sh -m long` runs them (before a GPU session: the GPU check's smoke run)
_LONG = (
    "tests/benchmarks/test_inner_parallelism_benchmark.py", "tests/benchmarks/test_chaos_benchmark.py",
    "tests/benchmarks/test_fabric_benchmark.py", "tests/benchmarks/test_overhead_benchmark.py",
    "tests/benchmarks/test_network_benchmarks.py", "tests/benchmarks/test_rounds_benchmark.py",
    "tests/benchmarks/test_fsdp_overhead_benchmark.py", "tests/benchmarks/test_synchronizer_benchmark.py",
    "tests/benchmarks/test_gpu_check.py::test_the_smoke_run_in_a_bare_environment",
    "tests/recipes/test_recipes_run.py::test_a_killed_fsdp2_island_resumes",  # tests/learner/test_fsdp_islands.py resumes one exactly
    "tests/recipes/test_recipes_run.py::test_compare_runs_ddp_and_diloco",
    "tests/recipes/test_litgpt_pretrain.py::test_litgpt_islands_learn",
)


# slow (multi-process) tests that guard what a user relies on, run by the default tier all the
# same (pyproject addopts): the README's and the Lightning page's commands as written, DDP, Fabric
# and FSDP2 islands on one synchronizer, a Fabric FSDP2 island resumed from its checkpoint, the
# synchronizer SIGKILLed under load, the chaos run (kills, a pause, a synchronizer restart). About
# 9.5 minutes of test time, under 5 on two workers (2026-11-28, this machine at load 8)
_GUARDS = (
    "tests/docs/test_commands.py::test_the_commands_of_a_page_run_as_written[README.md]",
    "tests/docs/test_commands.py::test_the_commands_of_a_page_run_as_written[docs/lightning.md]",
    "tests/learner/test_islands_multiprocess.py::test_two_islands_contribute_and_the_last_to_end_holds_the_final_global_model",
    "tests/learner/test_fabric_strategy.py::test_two_fabric_islands_share_one_synchronizer_and_end_on_the_global_model",
    "tests/learner/test_fabric_fsdp.py::test_a_fabric_fsdp_island_trains_on_a_synchronizer_ends_on_the_global_model_and_resumes",
    "tests/adversarial/test_crash.py::test_sigkill_under_load_loses_no_version_handed_out",
    "tests/launch/test_run_chaos.py::test_three_islands_survive_kills_a_pause_and_a_synchronizer_restart",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(part in item.nodeid for part in _FIXED_NETWORKS):
            item.add_marker(pytest.mark.xdist_group("fixed-networks"))
        if any(item.nodeid.startswith(prefix) for prefix in _LONG):
            item.add_marker(pytest.mark.long)
        if any(item.nodeid.startswith(prefix) for prefix in _GUARDS):
            item.add_marker(pytest.mark.guard)


def pytest_configure(config):
    """Every temporary file of the session (ours, Lightning's, subprocesses') goes to one private
    directory, so a test that leaves one behind is seen, and nothing outlives the session."""
    private = tempfile.mkdtemp(prefix="diloco-tests-")
    config.stash[_PRIVATE_TMP] = private
    os.environ["TMPDIR"] = private
    tempfile.tempdir = private


def pytest_unconfigure(config):
    private = config.stash.get(_PRIVATE_TMP, None)
    if private:
        shutil.rmtree(private, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks():
    threads_before = {t.ident for t in threading.enumerate()}
    children_before, ports_before, files_before = _children(), _listening_ports(), _temporary_files()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = {
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.ident not in threads_before and t.is_alive() and t.name not in _SESSION_THREADS),
            "child processes": sorted(_children() - children_before),
            "listening ports": sorted(_listening_ports() - ports_before),
            "temporary files": sorted(_temporary_files() - files_before),
        }
        if not any(leaked.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    leaks = {what: items for what, items in leaked.items() if items}
    assert not leaks, f"test leaked {leaks}"


@pytest.fixture
def two_torch_threads():
    """torch at 2 threads (a training thread's default on 2 cores) for the test, then back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
