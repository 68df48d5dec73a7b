"""An island that ends its run leaves it (the Leave call): rounds stop waiting for it at once,
and a quorum of K counts at most the islands still in the run. Only its own current session may
leave; a left island may join again as any island."""

import dataclasses
import time

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.synchronizer import closers
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config, wait_for_version


def _run_of(islands, *, min_quorum, **kwargs):
    """A run of ``islands`` islands, all joined (saying the run's count), fragments seeded; their sessions."""
    config = run_config(min_quorum=min_quorum, overlap=0)
    kwargs.setdefault("clock", FakeClock())
    sync = Synchronizer(config, SynchronizerSettings(**kwargs))
    sessions = [sync.join(i, 1, SPECS, num_islands=islands).session for i in range(islands)]
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, get_codec("fp32").encode(value), session=sessions[0])
    return sync, config, sessions


def _push(sync, config, island, session, seq=1):
    delta = torch.full((layout(config).fragment_numel(0),), 0.01)
    return sync.push(dataclasses.replace(contribution(config, island, 0, delta, seq=seq), session=session))


def test_a_round_of_quorum_k_closes_with_the_island_left_once_the_others_left():
    """K = M = 4 and three islands done: the last one's rounds waited for a quorum no island left
    in the run could make, its whole push wait (120 s) at every due fragment."""
    sync, config, sessions = _run_of(4, min_quorum=4)
    _push(sync, config, 0, sessions[0])
    assert sync.poll() == []  # 1 of 4
    sync.leave(1, session=sessions[1])
    sync.leave(2, session=sessions[2])
    assert sync.poll() == []  # 1 of the 2 still in the run
    sync.leave(3, session=sessions[3])
    [closed] = sync.poll()  # no time passed: not a liveness timeout
    assert closed.islands == (0,) and closed.version == 1 and "every live island contributed" in closed.reason
    status = sync.status()
    assert status.live_islands == [0]
    assert [i for i, isl in status.islands.items() if isl.left] == [1, 2, 3]
    assert not any(isl.live for i, isl in status.islands.items() if i != 0)


def test_an_island_that_left_is_not_live_nor_on_the_clock():
    """Left, an island is no longer live at once (not after the liveness timeout), and its place
    no longer counts on the run's clock."""
    sync, config, sessions = _run_of(3, min_quorum=1)
    for i, place in ((1, 3), (2, 3)):
        sync.heartbeat(i, place, 1.0, schedule_step=place, session=sessions[i])
    assert sync.run.run_step() == 3  # the lower median of 0, 3, 3
    sync.leave(1, session=sessions[1])
    assert sync.run.run_step() == 0  # of 0 and 3
    assert sync.live_islands() == {0, 2}


def test_closers_wake_when_an_island_leaves(monkeypatch):
    """A round short of its quorum sleeps until something notifies it; a Leave does."""
    monkeypatch.setattr(closers, "IDLE_WAIT", 600.0)  # no safety-net look within the test
    sync, config, sessions = _run_of(2, min_quorum=2, clock=time.monotonic)
    sync.start()
    try:
        _push(sync, config, 0, sessions[0])
        sync.leave(1, session=sessions[1])
        assert wait_for_version(sync.pull, 0, 1, timeout=30)[0] == 1
    finally:
        sync.shutdown()


def test_a_leave_from_another_session_is_refused_and_changes_nothing():
    sync, config, sessions = _run_of(2, min_quorum=2)
    stale = sessions[1]
    sessions[1] = sync.join(1, 1, SPECS, num_islands=2, previous_session=stale).session  # island 1's client joined again
    for island, session, reason in [(1, stale, "wrong_session"),  # its old session
                                    (0, sessions[1], "wrong_session"),  # island 1's session, as island 0
                                    (0, "", "wrong_session"),  # no session
                                    (5, sessions[0], "not_joined")]:  # an island not in the run
        with pytest.raises(Refusal) as refused:
            sync.leave(island, session=session)
        assert refused.value.reason == reason
    status = sync.status()
    assert status.live_islands == [0, 1] and not any(isl.left for isl in status.islands.values())
    assert status.refused == {"wrong_session": 3, "not_joined": 1}
    _push(sync, config, 0, sessions[0])
    assert sync.poll() == []  # still a quorum of 2


def test_a_left_island_is_not_joined_until_it_joins_again_then_counts_as_before():
    sync, config, sessions = _run_of(2, min_quorum=2)
    _push(sync, config, 1, sessions[1])  # its work before it left stays in the round
    sync.leave(1, session=sessions[1])
    for call in (lambda: sync.leave(1, session=sessions[1]),  # a second leave
                 lambda: sync.heartbeat(1, 5, 0.1, session=sessions[1]),
                 lambda: _push(sync, config, 1, sessions[1], seq=2)):
        with pytest.raises(Refusal) as refused:
            call()
        assert refused.value.reason == "not_joined"
    assert sync.live_islands() == {0} and sync.status().islands[1].left
    # a join again, from a new process (no session of its own): the left island is not running
    session = sync.join(1, 1, SPECS, num_islands=2, previous_session="").session
    assert sync.live_islands() == {0, 1} and not sync.status().islands[1].left
    _push(sync, config, 1, session, seq=2)  # one entry per island: its newer work replaces the old
    assert sync.run.fragments[0].rounds.islands() == {1}
    assert sync.poll() == []  # the quorum is 2 again
    _push(sync, config, 0, sessions[0])
    [closed] = sync.poll()
    assert closed.islands == (0, 1)


def test_a_restarted_synchronizer_remembers_the_islands_that_left(tmp_path):
    """It forgot them: after a restart a quorum of K = M counted the islands that had ended their
    run again, and the last island's rounds waited for them at every due fragment."""
    sync, config, sessions = _run_of(4, min_quorum=4, checkpoint_dir=tmp_path, checkpoint_every=1)
    for i in (1, 2, 3):
        sync.leave(i, session=sessions[i])
    _push(sync, config, 0, sessions[0])
    [closed] = sync.poll()  # island 0 alone is the run now; the close writes a checkpoint
    assert closed.islands == (0,)
    sync.shutdown()
    restarted = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, clock=FakeClock()))
    session = restarted.join(0, 1, SPECS, num_islands=4).session
    assert [i for i, isl in restarted.status().islands.items() if isl.left] == [1, 2, 3]
    delta = torch.full((layout(config).fragment_numel(0),), 0.01)
    ack = restarted.push(dataclasses.replace(contribution(config, 0, 0, delta, round=1, base_version=1, seq=2), session=session))
    [closed] = restarted.poll()  # no time passed: the three are still out of the quorum
    assert closed.islands == (0,) and not ack.late
    # one of them coming back counts again
    restarted.join(2, 1, SPECS, num_islands=4)
    assert [i for i, isl in restarted.status().islands.items() if isl.left] == [1, 3]


def test_a_slow_starters_late_contributions_close_rounds_once_the_other_islands_left():
    """An island whose first steps were slow (a torch.compile warm-up) sends for rounds the others
    closed long ago: its entries are late and wait in the next round, which only an on-time send
    opened. With the others gone none came, and it ended with 0 of 8 contributions merged."""
    from tests.helpers import with_peer_votes

    sync, config, sessions = _run_of(2, min_quorum=1)
    with_peer_votes(sync, [0, 1])
    delta = torch.full((layout(config).fragment_numel(0),), 0.01)
    for r in range(2):  # island 0 trains on; island 1 is still compiling
        sync.push(dataclasses.replace(contribution(config, 0, 0, delta, round=r, base_version=r, seq=r + 1),
                                      session=sessions[0]))
        [closed] = sync.poll()
        assert closed.islands == (0,)
    sync.leave(0, session=sessions[0])
    ack = sync.push(dataclasses.replace(contribution(config, 1, 0, delta, round=0, base_version=0, seq=1), session=sessions[1]))
    assert ack.late  # for round 0, which closed long ago
    [closed] = sync.poll()  # every island still in the run has its entry here: nobody else will open the round
    assert closed.islands == (1,) and closed.late == 1 and closed.version == 3
    assert sync.status().islands[1].accepted == 1
