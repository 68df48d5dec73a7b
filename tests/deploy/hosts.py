"""Machines for the deployment tests: named network namespaces on one bridge.

Each host is a network namespace (:mod:`benchmarks.netns`, on 10.78.0.0/24: nothing leaves the
bridge) with a hostname of its own (a UTS namespace per command) and an ``/etc/hosts`` naming every
host (``ip netns exec`` mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``). So commands written for
separate machines run unchanged: a torchrun rendezvous at ``node0:29400``, a synchronizer at
``sync-host:7470``, gloo finding a node's address from its hostname, Lightning's SLURM environment
taking the first name of ``node[0-1]``.

Leaving a :class:`Hosts` (even on failure) kills every process still in its namespaces and removes
them. One set of hosts on the machine at a time (a file lock): two test runs wait for each other
rather than tear down each other's namespaces.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.netns import Namespaces
from benchmarks.netns import unavailable as namespaces_unavailable

NET = 78  # 10.78.0.0/24; the bandwidth and WAN benchmarks use 10.77
PREFIX = "dlmn"
LOCK = Path("/run/lightning-diloco-hosts.lock")


def unavailable() -> str | None:
    """Why these hosts cannot be made here, or None."""
    reason = namespaces_unavailable()
    if reason:
        return reason
    for tool in ("unshare", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install util-linux iproute2)"
    return None


class Hosts:
    """``names[i]`` is host i, at 10.78.0.(i + 2); ``aliases``: more names of a host (a fully
    qualified one, or a service's name standing for its address)."""

    def __init__(self, names: Sequence[str], aliases: dict[str, Sequence[str]] | None = None) -> None:
        self.names = list(names)
        self.aliases = dict(aliases or {})
        self.namespaces = Namespaces(len(self.names), prefix=PREFIX, net=NET)
        self._lock = None
        self.started: list[subprocess.Popen] = []

    def address(self, name: str) -> str:
        return self.namespaces.address(self.names.index(name))

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``name``: in its namespace, under its hostname."""
        namespace = self.namespaces.names[self.names.index(name)]
        return ["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name, *argv]

    def start(self, name: str, argv: Sequence[str], log: Path, **popen) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen(self.command(name, argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, **popen)
        self.started.append(proc)
        return proc

    def peers(self, name: str, port: int) -> set[str]:
        """Addresses with an established TCP connection to ``port`` on host ``name``."""
        namespace = self.namespaces.names[self.names.index(name)]
        out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-Htn", "state", "established", f"sport = :{port}"],
                             capture_output=True, text=True, timeout=30).stdout
        # columns: Recv-Q Send-Q Local:Port Peer:Port; an IPv4 peer of a dual-stack socket reads [::ffff:10.78.0.2]:58492
        return {line.split()[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for line in out.splitlines() if line.strip()}

    def __enter__(self) -> Hosts:
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self._remove_host_files()
            self.namespaces.__enter__()
            table = "127.0.0.1 localhost\n" + "".join(f"{self.address(n)} {' '.join([n, *self.aliases.get(n, ())])}\n"
                                                       for n in self.names)
            for namespace in self.namespaces.names:
                folder = Path("/etc/netns") / namespace
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(table)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kill_everything()
            for proc in self.started:
                proc.wait(timeout=30)  # reaped: no zombie outlives the test
            self.namespaces.remove()
            self._remove_host_files()
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the lock
                self._lock = None

    def kill_everything(self) -> None:
        """SIGKILL every process in the hosts' namespaces (torchrun's workers run in sessions of
        their own, so a process group kill would miss them), and wait until none is left."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = set()
            for namespace in self.namespaces.names:
                listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
                pids.update(int(p) for p in listed.stdout.split())
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def _remove_host_files(self) -> None:
        for namespace in self.namespaces.names:
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        try:
            Path("/etc/netns").rmdir()  # when nothing else uses it
        except OSError:
            pass


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, every: float = 0.5,
             probe: Callable[[], None] | None = None) -> list[int]:
    """Wait for ``procs`` to exit, calling ``probe`` every ``every`` seconds meanwhile; their exit
    codes. Past ``timeout`` raise (the caller's :class:`Hosts` kills what is left)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still running after {timeout:.0f} s: {[p.args[-1] for p in procs if p.poll() is None]}")
        if probe is not None:
            probe()
        time.sleep(every)
    return [p.returncode for p in procs]


def wait_for_text(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before printing {text!r}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"did not print {text!r} within {timeout:.0f} s:\n{tail(log)}")
        time.sleep(0.2)


def tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""
