"""The ``lightning-diloco`` command's answers to plausible mistakes (no process is started)."""

import pytest

from lightning_diloco.cli import main


@pytest.mark.parametrize(("argv", "said"), [
    (["synchronizer", "--prot", "7470"], "unrecognized arguments: --prot 7470 (did you mean --port?)"),
    (["synchronizer", "--min_quorum=2"], "(did you mean --min-quorum?)"),
    (["status", "127.0.0.1:7470", "--jsn"], "(did you mean --json?)"),
    (["run", "--islands", "2", "--stager", "3", "--", "python", "x.py"], "(did you mean --stagger?)"),
])
def test_a_misspelt_flag_is_refused_by_its_command_naming_the_flag_meant(argv, said, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"lightning-diloco {argv[0]}: error: " in err and said in err, err


def test_a_training_command_without_the_separator_is_told_to_go_after_it(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", "--islands", "2", "python", "examples/train_lm.py"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "the training command goes after --, e.g. lightning-diloco run --islands 2 -- python examples/train_lm.py" in err, err


@pytest.mark.parametrize(("argv", "flag"), [
    (["synchronizer"], "--num-shards"), (["synchronizer"], "--liveness-timeout"), (["synchronizer"], "--max-workers"),
    (["run"], "--max-restarts"), (["run"], "--restart-backoff"), (["run"], "--liveness-timeout"),
    (["run"], "--checkpoint-every"), (["run"], "--chaos-horizon"),
])
def test_the_help_says_each_numeric_flags_default(argv, flag, capsys):
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    entry = help_text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
    assert "(default " in entry, f"{flag}: {entry}"
