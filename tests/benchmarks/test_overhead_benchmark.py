import pytest

from benchmarks import overhead

pytestmark = pytest.mark.slow


def test_overhead_benchmark_prints_the_step_time_ratio_of_both_island_sizes(capsys):
    results = overhead.main(["--steps", "12", "--warmup", "2", "--hidden", "64", "--layers", "1", "--vocab", "256",
                             "--seq", "16", "--batch", "2", "--repeats", "1", "--num-fragments", "8"])
    assert set(results) == {1, 2}
    for result in results.values():
        assert result["ratio"] > 0 and result["syncs_applied"] >= 1
    out = capsys.readouterr().out
    assert "step-time ratio diloco / plain (1 process(es))" in out
    assert "step-time ratio diloco / plain (2 process(es))" in out
    # each arm's CPU per step by thread: the island's own threads are there, and a one-process
    # island's embedded synchronizer is called without gRPC (no workers, no gRPC core threads)
    cpu = results[1]["diloco_cpu_ms_per_step"]
    assert cpu["training loop"] > 0 and "diloco-closer-N" in cpu and "diloco-islandN-sync_N" in cpu
    assert not [group for group in cpu if group.startswith(("diloco-sync", "native grpc", "native event_engine"))]
    assert "CPU ms per step, diloco" in out
    # each arm's minor page faults per step by thread, the training loop and the closers among them
    faults = results[1]["diloco_faults_per_step"]
    assert "training loop" in results[1]["plain_faults_per_step"] and {"training loop", "diloco-closer-N"} <= set(faults)
    assert all(n >= 0 for n in faults.values()) and sum(faults.values()) > 0  # counted from /proc, not left at 0
    assert "minor page faults per step, diloco" in out


def test_overhead_benchmark_can_leave_a_core_beside_a_one_process_island(capsys):
    results = overhead.main(["--steps", "8", "--warmup", "2", "--hidden", "64", "--layers", "1", "--vocab", "256",
                             "--seq", "16", "--batch", "2", "--repeats", "1", "--num-fragments", "8",
                             "--processes", "1", "--torch-threads", "1"])
    assert set(results) == {1} and results[1]["torch_threads"] == 1
    assert "one-process island vs single-device (1 torch thread(s) per process)" in capsys.readouterr().out
    # one torch thread: no OpenMP worker of the training beside the loop (with two it spends about as
    # much CPU as the loop itself)
    plain = results[1]["plain_cpu_ms_per_step"]
    assert sum(ms for group, ms in plain.items() if group != "training loop") < 0.25 * plain["training loop"]
