"""When a fragment's round closes: minimum quorum, then an adaptive grace window.

A pure decision over what the round has seen and the time ``now`` (monotonic seconds); the
service calls it whenever something changes and sleeps until the returned deadline otherwise.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundView:
    """What a decision needs to know about one open round."""

    contributors: Set[int]
    """Islands whose contribution is in this round (toward the quorum)."""
    on_time: Set[int]
    """Of those, the islands that sent for this round (not late for an earlier one): a round closes
    before its grace window only once every live island sent for it."""
    live: Set[int]
    """Islands currently considered alive (heartbeats within the timeout)."""
    opened_at: float
    """When the round's first contribution arrived."""
    quorum_at: float | None
    """When the round first had min_quorum contributors, or None."""
    lead_steps: int = 0
    """Steps the round's due step was ahead of the run's clock when it opened: an island ahead of
    the others opened it, and they reach the step about this many step times later."""


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str
    deadline: float | None = None
    """While waiting: the time at which the decision changes by itself (None: only new input)."""


def slack_steps(grace_slack: str, *, overlap_steps: int, sync_every: int) -> int:
    """The steps a round's grace window is a fraction of (``MergeConfig.grace_slack``).

    ``overlap`` (the paper): tau, how long an island trains on before it needs the reply.
    ``round``: H, until the fragment is due again. An island that overlaps (tau >= 1) does not
    wait for a late reply, it applies it when it comes, so waiting past tau costs an apply a few
    steps later; closing before the others' sends costs their contributions a round (merged into
    the next one, against an older base). An island at tau = 0 waits for its round: no slack.
    """
    if overlap_steps == 0:
        return 0
    return sync_every if grace_slack == "round" else overlap_steps


def grace_window(*, gamma: float, slack_steps: int, step_time: float, time_to_quorum: float, sync_time: float) -> float:
    """gamma * max(0, slack_steps * step_time - time_to_quorum - sync_time), in seconds.

    Waiting the whole slack would leave nothing for the merge and the reply before it runs out,
    so only a fraction gamma < 1 of it is spent on latecomers.
    """
    return gamma * max(0.0, slack_steps * step_time - time_to_quorum - sync_time)


def quorum_in_run(min_quorum: int, *, num_islands: int, left: int) -> int:
    """The contributors a round needs: K, but no more than the islands that can still send.

    An island that left the run (its training ended, or it was stopped: the Leave call) sends no
    more, so with ``left`` of the run's ``num_islands`` gone a round needs at most the rest (at
    least one). Without it, K = M made the last island running wait out its whole push wait at
    every due fragment once the others had finished. An island that died is no such case: it may
    come back, and with fewer than K alive a round still waits. ``num_islands`` 0: the run's count
    is not known, so neither is how many islands remain: K stands.
    """
    if not num_islands:
        return min_quorum
    return max(1, min(min_quorum, num_islands - left))


def decide(
    view: RoundView,
    now: float,
    *,
    min_quorum: int,
    gamma: float,
    slack_steps: int,
    step_time: float,
    sync_time: float,
) -> Decision:
    count = len(view.contributors)
    if count < min_quorum:
        return Decision(False, f"waiting for quorum: {count} of {min_quorum} islands")
    if view.live <= view.on_time:
        return Decision(True, f"every live island contributed ({count})")
    assert view.quorum_at is not None, "a round at quorum must know when it got there"
    grace = grace_window(
        gamma=gamma,
        slack_steps=slack_steps,
        step_time=step_time,
        time_to_quorum=view.quorum_at - view.opened_at,
        sync_time=sync_time,
    )
    # the window counts from the round's due step on the run's clock, not from an early send: on a
    # quiet 2-core host one island ran about 12 steps ahead of the others, opened most rounds, and
    # a window from its send closed before they reached the step (23-30% merged late, 2026-11-27).
    # Never past the whole slack (gamma 1), so no lead holds a round longer than that.
    if grace > 0 and view.lead_steps > 0:
        whole = grace_window(gamma=1.0, slack_steps=slack_steps, step_time=step_time,
                             time_to_quorum=view.quorum_at - view.opened_at, sync_time=sync_time)
        grace = min(grace + view.lead_steps * step_time, whole)
    closes_at = view.quorum_at + grace
    if now >= closes_at:
        why = "grace window elapsed" if grace > 0 else "quorum reached, no grace slack"
        return Decision(True, f"{why} ({count} of {len(view.live | view.contributors)} islands)")
    return Decision(False, f"grace window: {closes_at - now:.3f}s left for {len(view.live - view.contributors)} islands", closes_at)
