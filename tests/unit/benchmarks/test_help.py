"""docs/benchmarks.md: every benchmark's `--help` lists its options."""

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(p.stem for p in (Path(__file__).resolve().parents[3] / "benchmarks").glob("*.py")
                    if "def main(" in p.read_text())


def test_every_benchmark_is_found():
    assert {"codec", "goodput_sim", "rounds", "wan"} <= set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_lists_the_options(name, capsys):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"benchmarks.{name}").main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
