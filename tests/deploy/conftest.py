"""Fixtures of the deployment tests: named hosts (network namespaces, root only) and a scratch
clone to run the documented commands in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.hosts import Hosts, unavailable
from tests.docs.test_commands import _environment, _scratch


@pytest.fixture
def hosts_factory():
    """``hosts_factory(names, aliases=None)``: a :class:`Hosts` entered for the test, left
    (everything in it killed, the namespaces removed) when the test ends, whatever happened. One
    per test: every set of hosts takes the machine-wide lock."""
    reason = unavailable()
    if reason:
        pytest.skip(f"the deployment tests run commands on hosts made of network namespaces: {reason}")
    entered: list[Hosts] = []

    def make(names, aliases=None):
        hosts = Hosts(names, aliases).__enter__()
        entered.append(hosts)
        return hosts

    yield make
    for hosts in entered:
        hosts.__exit__()


@pytest.fixture
def clone(tmp_path) -> Path:
    """A folder that looks like a clone of the repository (links to its files), shared by every
    host as a cluster's shared file system would be; what the commands write stays in it. Its
    `.venv` is the running interpreter's environment, wherever the suite runs from."""
    return _scratch(tmp_path)


@pytest.fixture
def environment(tmp_path) -> dict[str, str]:
    """The documented commands' environment: this checkout's code, one thread per process, and
    temporary files (torchrun's among them) under the test's own folder."""
    env = _environment()
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    for name in list(env):
        # a test run inside a SLURM job or under torchrun must not hand its own ranks to the hosts
        if name.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_", "GROUP_RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")) \
                or name == "RANK":
            del env[name]
    return env
