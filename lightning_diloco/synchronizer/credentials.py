"""Per-island credentials, derived from the run's token: no registry to keep.

The credential of island i is ``island-<i>.<HMAC-SHA256(run token, "lightning-diloco island <i>")>``.
The synchronizer, holding the run token, checks one by recomputing it; a holder of island 1's
credential cannot compute island 0's, so it can act only as island 1 (with one shared
token any holder could join as any island, push with its id and lock it out). The run token
itself still acts as every island: it is the operator's key (the launcher, ``lightning-diloco
status``, an embedded synchronizer), not one to hand to an island. ``lightning-diloco credential
--island i`` prints island i's credential for the operator to hand out.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

PREFIX = "island-"


def island_credential(run_token: str, island: int) -> str:
    """The credential island ``island`` presents instead of the run token."""
    if island < 0:
        raise ValueError(f"island={island}: island ids are >= 0")
    return f"{PREFIX}{island}.{_mac(run_token, island)}"


def _mac(run_token: str, island: int) -> str:
    return hmac.new(run_token.encode(), f"lightning-diloco island {island}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who a call's credential says it comes from: one island, or the operator (``island`` None)."""

    island: int | None

    def may_act_as(self, island: int) -> bool:
        return self.island is None or self.island == island


def identify(run_token: str, presented: str) -> Caller | None:
    """The caller ``presented`` (the token after ``Bearer``) proves, or None when it proves nothing."""
    if hmac.compare_digest(presented.encode(), run_token.encode()):
        return Caller(None)
    head, dot, mac = presented.partition(".")
    if not dot or not head.startswith(PREFIX) or not head[len(PREFIX):].isdigit() or len(head) > len(PREFIX) + 10:
        return None
    island = int(head[len(PREFIX):])
    return Caller(island) if hmac.compare_digest(mac.encode(), _mac(run_token, island).encode()) else None
