"""Quorum and adaptive grace window as a pure decision; the clock is a parameter."""

import pytest

from lightning_diloco.core.quorum import RoundView, decide, grace_window, quorum_in_run, slack_steps

SETTINGS = dict(min_quorum=2, gamma=0.5, slack_steps=2, step_time=1.0, sync_time=0.1)


def _view(contributors, live, opened_at=0.0, quorum_at=None, late=()):
    return RoundView(contributors=frozenset(contributors), on_time=frozenset(contributors) - set(late),
                     live=frozenset(live), opened_at=opened_at, quorum_at=quorum_at)


def test_no_close_below_quorum_even_when_everyone_else_is_dead():
    d = decide(_view({0}, {0}), 100.0, **SETTINGS)
    assert not d.close and "1 of 2" in d.reason and d.deadline is None


def test_closes_at_once_when_every_live_island_contributed():
    d = decide(_view({0, 1}, {0, 1}, quorum_at=0.2), 0.2, **SETTINGS)
    assert d.close and "every live island" in d.reason


def test_late_entries_count_toward_quorum_but_do_not_close_the_round_early():
    """Islands in phase with quorum 1: three late entries and one on-time send are not "every
    live island contributed"; the round waits out its grace window for the others' sends."""
    view = _view({0, 1, 2, 3}, {0, 1, 2, 3}, quorum_at=0.0, late={1, 2, 3})
    wait = decide(view, 0.1, **SETTINGS)
    assert not wait.close and "grace window" in wait.reason
    assert decide(view, wait.deadline, **SETTINGS).close


def test_dead_islands_are_not_waited_for():
    d = decide(_view({0, 1}, {0, 1}, quorum_at=0.2), 0.2, **SETTINGS)  # island 2 left the live set
    assert d.close


def test_grace_window_formula_and_deadline():
    # slack = 2 steps - quorum - sync = 2 * 1.0 - 0.2 - 0.1 = 1.7; grace = 0.85
    assert grace_window(gamma=0.5, slack_steps=2, step_time=1.0, time_to_quorum=0.2, sync_time=0.1) == pytest.approx(0.85)
    view = _view({0, 1}, {0, 1, 2}, quorum_at=0.2)
    wait = decide(view, 0.5, **SETTINGS)
    assert not wait.close and wait.deadline == pytest.approx(1.05) and "grace window" in wait.reason
    assert decide(view, 1.05, **SETTINGS).close


@pytest.mark.parametrize("gamma", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("quorum_time", [0.0, 0.5, 1.9, 3.0])
def test_grace_never_exceeds_gamma_times_slack(gamma, quorum_time):
    settings = dict(SETTINGS, gamma=gamma)
    view = _view({0, 1}, {0, 1, 2}, quorum_at=quorum_time)
    slack = max(0.0, 2 * 1.0 - quorum_time - 0.1)
    assert decide(view, quorum_time + gamma * slack + 1e-9, **settings).close
    if gamma * slack > 1e-6:
        assert not decide(view, quorum_time + gamma * slack * 0.99, **settings).close


def test_no_slack_closes_at_quorum():
    settings = dict(SETTINGS, slack_steps=0)
    d = decide(_view({0, 1}, {0, 1, 2}, quorum_at=0.0), 0.0, **settings)
    assert d.close and "no grace" in d.reason


@pytest.mark.parametrize("min_quorum, num_islands, left, needed", [
    (4, 4, 0, 4), (4, 4, 3, 1), (4, 4, 4, 1),  # K = M: the islands still in the run
    (2, 4, 1, 2), (2, 4, 3, 1),  # K < M: lowered only once fewer than K remain
    (3, 0, 2, 3),  # the run's count unknown: how many remain is too, K stands
])
def test_the_quorum_counts_at_most_the_islands_still_in_the_run(min_quorum, num_islands, left, needed):
    assert quorum_in_run(min_quorum, num_islands=num_islands, left=left) == needed


@pytest.mark.parametrize("grace_slack, overlap_steps, expected", [
    ("round", 2, 24), ("round", 1, 24),  # overlapping islands never wait for a round: until the fragment is due again
    ("overlap", 2, 2), ("overlap", 1, 1),  # the paper's: until the island needs the reply
    ("round", 0, 0), ("overlap", 0, 0),  # synchronous islands wait for their round: close at quorum
])
def test_the_grace_slack_is_the_round_for_overlapping_islands_and_none_for_waiting_ones(grace_slack, overlap_steps, expected):
    assert slack_steps(grace_slack, overlap_steps=overlap_steps, sync_every=24) == expected


def test_a_round_opened_ahead_of_the_run_waits_from_its_due_step_but_never_past_the_slack():
    """Opened by an island 3 steps ahead of the run's clock, the others reach the due step 3 step
    times later: the window counts from there (gamma 0.5 of 2 steps, less the close, plus 3 steps),
    capped at the whole slack. With gamma 0 the round still closes at quorum."""
    settings = dict(SETTINGS, slack_steps=8)  # step 1 s: grace 0.5 * (8 - 0 - 0.1) = 3.95 s
    ahead = RoundView(contributors=frozenset({0}), on_time=frozenset({0}), live=frozenset({0, 1}), opened_at=0.0,
                      quorum_at=0.0, lead_steps=3)
    wait = decide(ahead, 0.0, **dict(settings, min_quorum=1))
    assert wait.deadline == pytest.approx(3.95 + 3.0)
    far_ahead = RoundView(**{**ahead.__dict__, "lead_steps": 50})
    assert decide(far_ahead, 0.0, **dict(settings, min_quorum=1)).deadline == pytest.approx(7.9)  # the whole slack
    assert decide(ahead, 0.0, **dict(settings, min_quorum=1, gamma=0.0)).close
