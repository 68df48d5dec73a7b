"""Toy-size runs of the benchmarks that need root, namespaces or many processes."""

import pytest

from benchmarks import bandwidth, netns, stragglers, wan
from lightning_diloco.launch.report import Sample

pytestmark = pytest.mark.slow
needs_netns = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))


def test_unit_rate_ignores_start_up_before_the_warm_step():
    samples = [Sample(t, 0, {0: s}, {0}) for t, s in [(0.0, 0), (5.0, 0), (6.0, 10), (7.0, 30), (8.0, 50)]]
    assert stragglers.unit_rate(samples, 0, steps=50, warm=10) == pytest.approx(20.0)


def test_stragglers_benchmark_compares_three_arms(capsys):
    result = stragglers.main(["--islands", "2", "--steps", "40", "--step-seconds", "0.02", "--slowdown", "3"])
    assert result["ddp_vs_ideal"] < 1.0 and result["diloco_vs_ddp"] > 0
    assert "throughput ratio diloco / ddp" in capsys.readouterr().out


@needs_netns
def test_bandwidth_benchmark_counts_link_bytes(capsys):
    summary = bandwidth.main(["--islands", "2", "--steps", "40", "--hidden", "32", "--only", "H=24 int4 up / int4"])
    assert summary["ddp"]["reduction"] == 1.0
    arm = summary["diloco H=24 int4 up / int4 down"]
    assert arm["reduction"] > 5 and arm["total_bytes"] > 0
    assert "B/token" in capsys.readouterr().out


@needs_netns
def test_wan_benchmark_times_both_arms_on_a_capped_link(capsys):
    rows = wan.main(["--islands", "2", "--steps", "30", "--eval-every", "10", "--rates", "50", "--hidden", "32"])
    assert rows[0]["rate_mbit"] == 50 and rows[0]["ddp_s"] is not None and rows[0]["diloco_s"] is not None
    assert "speedup" in capsys.readouterr().out
    assert not [n for n in netns.Namespaces(2).names if n in __import__("subprocess").run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout], "namespaces are removed"
