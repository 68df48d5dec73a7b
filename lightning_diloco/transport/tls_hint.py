"""Why a connection failed when the two ends disagree about TLS, said plainly.

gRPC reports a plaintext client meeting a TLS server as "Socket closed", and a TLS client meeting
a plaintext server as an OpenSSL "WRONG_VERSION_NUMBER": neither says what to change. When a call
gives up with one of those, the client probes the address once with a TLS handshake of its own
(no certificate check: it only asks whether TLS is spoken there) and names the fix.
"""

from __future__ import annotations

import socket
import ssl

PROBE_TIMEOUT = 2.0  # seconds


def speaks_tls(address: str, timeout: float = PROBE_TIMEOUT) -> bool | None:
    """Whether a TLS handshake succeeds at ``host:port`` (None: nothing answers there)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        return None
    try:
        with context.wrap_socket(raw, server_hostname=host):
            return True
    except (ssl.SSLError, OSError):
        return False
    finally:
        raw.close()


def tls_mismatch_hint(address: str, uses_tls: bool, details: str) -> str:
    """A sentence naming the fix when ``details`` look like a TLS mismatch that a probe confirms; else ''."""
    lowered = details.lower()
    if not uses_tls and "socket closed" in lowered and speaks_tls(address):
        return (f" -- the synchronizer at {address} serves TLS and this client connected in plaintext: give the client "
                "the server's certificate (tls_root_cert=..., the CA or self-signed PEM the server was started with)")
    if uses_tls and ("wrong_version_number" in lowered or "handshake failed" in lowered) and speaks_tls(address) is False:
        return (f" -- the synchronizer at {address} serves plaintext and this client connected with TLS: drop the "
                "client's certificate, or start the synchronizer with --tls-cert and --tls-key")
    return ""
