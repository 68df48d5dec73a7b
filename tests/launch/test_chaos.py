import random

import pytest

from lightning_diloco.launch.chaos import Fault, due_faults, parse_schedule, random_kills


def test_schedule_reads_every_kind_of_fault_in_time_order():
    faults = parse_schedule("kill 1 at 20s; pause 2 at 5s for 3s\nkill-synchronizer at 12.5s # comment\nkill 0 at step 40", num_islands=3)
    assert faults == [
        Fault("pause", 2, at_s=5.0, duration_s=3.0),
        Fault("kill-synchronizer", None, at_s=12.5),
        Fault("kill", 1, at_s=20.0),
        Fault("kill", 0, at_step=40),
    ]


def test_a_kill_can_keep_an_island_down_for_a_while():
    [fault] = parse_schedule("kill 2 at step 300 for 20s", num_islands=4)
    assert fault == Fault("kill", 2, at_step=300, duration_s=20.0)
    assert fault.describe() == "kill island 2 at step 300 for 20s"


def test_schedule_file_is_read_with_at_sign(tmp_path):
    path = tmp_path / "faults.txt"
    path.write_text("kill 0 at 1s\n\n# nothing else\n")
    assert parse_schedule(f"@{path}", num_islands=1) == [Fault("kill", 0, at_s=1.0)]


@pytest.mark.parametrize("text,match", [
    ("explode 1 at 3s", "cannot read fault"),
    ("kill 5 at 3s", "islands 0..2"),
    ("pause 1 at 3s", "needs a duration"),
    ("random mtbf 0s", "mtbf must be positive"),
])
def test_bad_schedules_are_refused_with_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        parse_schedule(text, num_islands=3)


def test_random_faults_are_seeded_and_bounded_by_the_horizon():
    a = parse_schedule("random mtbf 10s seed 7", num_islands=4, horizon_s=200)
    b = parse_schedule("random mtbf 10s seed 7", num_islands=4, horizon_s=200)
    c = parse_schedule("random mtbf 10s seed 8", num_islands=4, horizon_s=200)
    assert a == b and a != c
    assert all(f.kind == "kill" and 0 <= f.island < 4 and f.at_s < 200 for f in a)
    assert 8 <= len(a) <= 40  # about horizon / mtbf = 20


def test_mean_gap_of_random_kills_is_the_mtbf():
    faults = random_kills(5.0, 2, 50_000, random.Random(0))
    times = [f.at_s for f in faults]
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert sum(gaps) / len(gaps) == pytest.approx(5.0, rel=0.05)


def test_due_faults_fire_by_time_or_by_steps():
    faults = [Fault("kill", 0, at_s=10.0), Fault("kill", 1, at_step=100)]
    assert due_faults(faults, 5.0, {1: 99}) == []
    assert due_faults(faults, 10.0, {1: 99}) == [faults[0]]
    assert due_faults(faults, 0.0, {1: 100}) == [faults[1]]
