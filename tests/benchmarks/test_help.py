"""docs/benchmarks.md: every benchmark's `--help` lists its options."""

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
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


def test_the_codec_help_says_the_defaults_docs_benchmarks_md_quotes(capsys):
    """docs/benchmarks.md: 'the figures below used the defaults, 16M values and 5 repeats'."""
    with pytest.raises(SystemExit):
        importlib.import_module("benchmarks.codec").main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default 16M)" in out and "the best is reported (default 5)" in out and "int8/int4/int2 (default 64)" in out
