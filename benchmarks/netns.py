"""Network namespaces for the bandwidth and WAN benchmarks: one per island (or DDP rank).

Each namespace ``<prefix><i>`` has one veth link to a bridge in the root namespace; the bridge
holds the synchronizer's address (``10.<net>.0.1``) and namespace i has ``10.<net>.0.<i + 2>``.
Every byte an island sends or receives crosses its link, so the root-side interface's counters
are the island's traffic across its boundary. Links can be capped with ``tc ... tbf`` in both
directions (this kernel has tbf and htb; no netem, so no emulated latency).

Everything is created on entry and deleted on exit; entry first removes leftovers with the same
prefix, so a crashed earlier run does not block the next. Needs root and ``ip``/``tc``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root; run as root (or skip this benchmark)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2)"
    probe = subprocess.run(["ip", "netns", "add", "dlprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "dlprobe"], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


class Namespaces:
    def __init__(self, count: int, prefix: str = "dlb", net: int = 77, rate_mbit: float | None = None) -> None:
        self.count, self.prefix, self.net, self.rate_mbit = count, prefix, net, rate_mbit
        self.bridge = f"{prefix}br"
        self.names = [f"{prefix}{i}" for i in range(count)]

    @property
    def hub(self) -> str:
        """The root namespace's address on the bridge (where the synchronizer listens)."""
        return f"10.{self.net}.0.1"

    def address(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 2}"

    def inner_link(self, i: int) -> str:
        """The namespace-side interface name (GLOO_SOCKET_IFNAME for DDP ranks)."""
        return f"{self.prefix}n{i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def __enter__(self) -> Namespaces:
        self.remove()  # leftovers of a crashed run with the same prefix
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "addr", "add", f"{self.hub}/24", "dev", self.bridge)
            _ip("ip", "link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                host, inner = f"{self.prefix}h{i}", self.inner_link(i)
                _ip("ip", "netns", "add", ns)
                _ip("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
                _ip("ip", "link", "set", inner, "netns", ns)
                _ip("ip", "link", "set", host, "master", self.bridge)
                _ip("ip", "link", "set", host, "up")
                _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", inner, ns=ns)
                _ip("ip", "link", "set", inner, "up", ns=ns)
                _ip("ip", "link", "set", "lo", "up", ns=ns)
                if self.rate_mbit:
                    self._cap(host, None)  # towards the island
                    self._cap(inner, ns)  # from the island
        except BaseException:
            self.remove()
            raise
        return self

    def _cap(self, dev: str, ns: str | None) -> None:
        rate = f"{self.rate_mbit}mbit"
        # burst: a few milliseconds of traffic at the rate, at least 32 KiB so the qdisc can pass a
        # full-size segment train; latency bounds the queue (a deep buffer, like a WAN router's)
        burst = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.004))
        _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "400ms", ns=ns)

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for i, ns in enumerate(self.names):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{self.prefix}h{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def counters(self) -> list[tuple[int, int]]:
        """(bytes the island sent, bytes it received) per namespace, from the root-side links."""
        out = []
        for i in range(self.count):
            stats = Path(f"/sys/class/net/{self.prefix}h{i}/statistics")
            # the root side's rx is what the island transmitted, and its tx what the island received
            out.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
        return out
