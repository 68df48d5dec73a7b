"""Push admission: every rule a push is refused by, in the order it is checked, with its reason.

A push is admitted once, from its header, before a byte of its payload is read (steps 1-8: a
stream from no session, or for no fragment, holds no worker while its bytes trickle in); its
payload is then received and checked as it is decoded, and the push is put into its round. The
order, and the reason each refusal carries (Status counts them):

====  ==========================================================  =================================
step  what is checked                                             refused as
====  ==========================================================  =================================
1     the fragment is one of the run's, owned by this shard       ``unknown_fragment``
2     the run has a layout (an island has joined)                 ``not_joined``
3     the island joined, and this is its current session          ``not_joined``, ``wrong_session``
4     the layout hash is the run's                                ``layout_mismatch``
5     tokens and steps are counts a real island reports           ``bad_counters``
6     sequence number, round and base version are >= 0            ``bad_sequence``
7     the codec is one of the run's                               ``unknown_codec``
8     the size the header declares is the codec's for the         ``bad_payload``
      fragment (a stream's header: the server's pushes)
      *the payload is read* (the server: whole, within its        ``bad_payload``
      deadline, deadlines.py)
9     the payload decodes: its size, its values finite            ``bad_payload``, ``non_finite``
10    the fragment has a value (it was seeded)                    ``not_seeded``
11    its sequence number is newer than the island's last one     ``old_sequence``,
      in this session, or a true retry (rounds.py)                ``sequence_reused``
12    the round has room for one more island                      ``busy``
====  ==========================================================  =================================

Where each is checked, in this order: steps 1-3, the checks every request of an island passes, in
``Synchronizer.push`` (service.py); steps 4-8 in ``Fragment.admit`` and 9-12 in ``Fragment.push``
(fragment.py), with the functions below. The server authenticates the caller, and checks the
island it acts as, before step 1. Nothing is
refused after step 12: a push sent for a round the run has not reached is taken for the latest
round it admits (:func:`admitted_round`), so no island can open a round ahead of the run.

Why the round is bounded so (admission.py says why every number a client sends is): a send is
admitted for a round at most one round (``lead_steps`` = H) past the later of the run's clock and
its island's own place (membership.py: a place advances no faster than a rate, and only the
island's own steps or a request for a round due on the clock move it). The fragment's next round
is no floor: one island that sent for it as soon as the last round closed opened and closed rounds
alone, as fast as a grace window allows, each an outer step of its contribution alone. Nor is the
clock plus a lead of 4H: one island that sent for round 2**40 after every close had each send
taken for the round 4H ahead, which opened it, asked every honest island to skip to it, and so
moved the clock 4H each time. (A restarted synchronizer's islands join at the step of its latest
round, so its next round stays admitted.)
"""

from __future__ import annotations

from lightning_diloco.core.protocol import Contribution
from lightning_diloco.core.schedule import latest_round
from lightning_diloco.reasons import Reason

# A contribution weighs tokens**2 / steps: past these bounds no real island reports, and within
# them the weight stays finite in float64 however a client fills the fields. Below MIN_TOKENS the
# square underflows to 0 (tokens=1e-200: a weight of 0.0): a round of such entries, or of one and
# an honest one (the weights are capped at a multiple of their lower median, 0), had no positive
# weight and its close failed on every look, so the fragment never stepped again.
MIN_TOKENS = 1e-6
MAX_TOKENS = 1e15
MAX_STEPS = 10**9


def contribution_problem(c: Contribution, layout_hash: str) -> tuple[Reason, str] | None:
    """Steps 4-6: why the fields of ``c`` cannot be taken as they are, or None."""
    if c.layout_hash != layout_hash:
        return Reason.LAYOUT_MISMATCH, f"layout hash {c.layout_hash[:40]!r} is not the run's {layout_hash!r}; rejoin with the run's model"
    if not (1 <= c.steps <= MAX_STEPS) or not (MIN_TOKENS <= c.tokens <= MAX_TOKENS) or c.tokens != c.tokens:
        return Reason.BAD_COUNTERS, (f"counters tokens={c.tokens} steps={c.steps} are out of range "
                                     f"({MIN_TOKENS:g} <= tokens <= {MAX_TOKENS:g}, 1 <= steps <= {MAX_STEPS})")
    negative = [f"{name}={value}" for name, value in (("seq", c.seq), ("round", c.round), ("base_version", c.base_version))
                if value < 0]
    if negative:
        return Reason.BAD_SEQUENCE, f"{', '.join(negative)}: the sequence number, round and base version must be >= 0"
    return None


def declared_size_problem(what: str, declared: int, expected: int) -> str | None:
    """Step 8 (a seed's stream too): the size a header declares is the one its payload must have."""
    if declared != expected:
        return f"{what} declares {declared} bytes but its codec and fragment need {expected}"
    return None


def admitted_round(sent_for: int, *, clock_step: int, place: int, lead_steps: int, offset: int, sync_every: int) -> int:
    """The round a send for ``sent_for`` is taken for: itself, or the latest round the run admits,
    due by ``lead_steps`` past the later of the run's clock and the sending island's ``place``
    (its place may lag its sends by a heartbeat; an island behind the clock is asked to catch up
    to it, and its send for the round it was asked for is admitted)."""
    return min(sent_for, max(0, latest_round(max(clock_step, place) + lead_steps, offset, sync_every)))
