"""A new run never continues an earlier one in its folder by accident (launch/workdir.py)."""

import pytest

from lightning_diloco.launch.options import RunOptions
from lightning_diloco.launch.run import Run
from lightning_diloco.launch.workdir import FolderInUse, earlier_run, set_aside


def _earlier_run(folder):
    (folder / "synchronizer").mkdir(parents=True)
    (folder / "synchronizer" / "state.pt").write_bytes(b"x")
    (folder / "progress-1.txt").write_text("951")


def test_an_earlier_run_is_moved_aside_and_the_new_run_starts_empty(tmp_path):
    work = tmp_path / "work"
    _earlier_run(work)
    note = set_aside(work, resume=False)
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("work.prev-")]
    assert len(moved) == 1 and (moved[0] / "progress-1.txt").read_text() == "951"
    assert work.is_dir() and not any(work.iterdir())
    assert note.count("\n") == 1 and str(moved[0]) in note and "--resume" in note
    _earlier_run(work)  # a third run within the same second gets its own sibling
    set_aside(work, resume=False)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("work.prev-")]) == 2


def test_resume_keeps_the_earlier_run(tmp_path):
    _earlier_run(tmp_path / "work")
    assert "continuing" in set_aside(tmp_path / "work", resume=True)
    assert (tmp_path / "work" / "progress-1.txt").read_text() == "951"
    assert "no earlier run" in set_aside(tmp_path / "empty", resume=True)


def test_a_folder_without_a_run_is_used_as_it_is(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert set_aside(tmp_path, resume=False) is None and (tmp_path / "notes.txt").exists()
    assert set_aside(tmp_path / "missing", resume=False) is None
    assert earlier_run(tmp_path) == []


def test_the_launchers_own_logs_are_part_of_the_run(tmp_path):
    _earlier_run(tmp_path / "work")
    for name in ("island-0.log", "synchronizer.log"):
        (tmp_path / "work" / name).write_text("x")
    assert "moved it to" in set_aside(tmp_path / "work", resume=False)


def test_a_run_beside_other_files_is_refused_with_the_fix_never_moved(tmp_path):
    _earlier_run(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(FolderInUse, match=r"--resume.*--workdir"):
        set_aside(tmp_path, resume=False)
    assert (tmp_path / "train.py").exists() and (tmp_path / "progress-1.txt").exists()


def test_the_current_directory_is_never_moved(tmp_path, monkeypatch):
    _earlier_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FolderInUse, match="current directory"):
        set_aside(".", resume=False)


def test_the_launcher_moves_an_earlier_run_aside_unless_told_to_resume(tmp_path, capsys):
    work = tmp_path / "work"
    _earlier_run(work)
    Run(RunOptions(workdir=str(work), resume=True, synchronizer="127.0.0.1:1"), ["true"])
    assert (work / "progress-1.txt").exists()  # the stale progress file a step-triggered fault would read
    Run(RunOptions(workdir=str(work), synchronizer="127.0.0.1:1"), ["true"])
    assert not (work / "progress-1.txt").exists()
    out = capsys.readouterr().out
    assert "continuing the run" in out and "held an earlier run: moved it to" in out
