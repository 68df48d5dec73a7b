"""A synchronizer address whose host does not resolve is a wrong address, not a synchronizer
that is away: it is said within seconds, naming the host, instead of being retried like one that
does not answer (gRPC retries a failed name lookup as it retries a refused connection, so the
island said nothing clear until its ``join_wait`` was over, 5 minutes by default)."""

from __future__ import annotations

import logging
import socket
import time

log = logging.getLogger(__name__)

RESOLVE_PATIENCE = 10.0
"""Seconds a host that does not resolve is looked up again before the join fails: a DNS name
created with the synchronizer (a Kubernetes Service applied beside the islands) appears within them."""

NOT_KNOWN = {socket.EAI_NONAME} | ({socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA") else set())
"""getaddrinfo's answers that the name does not exist (a failing DNS server is not one)."""


def host_of(address: str) -> str | None:
    """The host of ``host:port`` (an IPv6 one unbracketed); None for an address with a scheme
    (``unix:``, ``dns:///``), which gRPC resolves its own way."""
    host = address.rpartition(":")[0]
    if "/" in host or host.startswith("unix"):
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def check_resolves(addresses: list[str], patience: float = RESOLVE_PATIENCE) -> None:
    """Raise ``ValueError`` naming the first of ``addresses`` whose host the system's
    resolver says does not exist, after looking it up again for ``patience`` seconds."""
    for address in addresses:
        host = host_of(address)
        if host is None:
            continue
        began = time.monotonic()
        said = False
        while True:
            try:
                socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                break
            except socket.gaierror as err:
                waited = time.monotonic() - began
                if err.errno not in NOT_KNOWN:
                    break  # the resolver itself failed: gRPC's retries and their messages take it from here
                if waited >= patience:
                    raise ValueError(
                        f"the synchronizer's host {host!r} (address {address}) does not resolve ({err.strerror}; looked up "
                        f"for {waited:.0f} s): check the host name of the address (DILOCO_SYNCHRONIZER, or the strategy's "
                        "synchronizer=)") from None
                if not said:  # at once: the error itself comes only after the patience
                    said = True
                    log.warning("the synchronizer's host %r (address %s) does not resolve (%s); looking it up again for "
                                "%.0f s before failing", host, address, err.strerror, patience)
            time.sleep(1.0)  # between lookups
