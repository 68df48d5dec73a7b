"""One island cannot move the run's clock or stretch the grace window: a heartbeat
claiming schedule step 2**62, or a step time of 1e9 s, and honest rounds still open and close."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.transport.client import SynchronizerClient
from tests.adversarial.conftest import Target
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version


@pytest.fixture
def pair():
    """A real server with grace slack (gamma 0.5, tau 2), an honest island 0 and a hostile island 1."""
    config = run_config(num_fragments=2, min_quorum=1, gamma=0.5, overlap=2)
    server = SynchronizerServer(Synchronizer(config), max_workers=24).start()
    honest = SynchronizerClient(server.address, max_retries=1, backoff=0.05)
    attacker = SynchronizerClient(server.address, max_retries=1, backoff=0.05)
    honest.join(0, 1, SPECS)
    for p, value in initial_fragments(config).items():
        honest.seed(0, p, value)
    attacker.join(1, 1, SPECS)
    yield Target(server, honest, config), attacker
    attacker.close()
    honest.close()
    server.stop(grace=0)


def _keep_sending(stop: threading.Event, beat) -> threading.Thread:
    def loop():
        while not stop.is_set():
            beat()
            stop.wait(0.05)

    thread = threading.Thread(target=loop, name="diloco-test-attacker", daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("attack", ["schedule_step", "step_time"])
def test_one_island_cannot_stall_honest_rounds_with_its_clock_or_step_time(pair, attack):
    target, attacker = pair
    numel = layout(target.config).fragment_numel(0)
    stop = threading.Event()
    if attack == "schedule_step":
        beat = lambda: attacker.heartbeat(1, 10**9, 0.01, schedule_step=2**62)  # noqa: E731
    else:
        beat = lambda: attacker.heartbeat(1, 10, 1e9, schedule_step=10)  # noqa: E731
    thread = _keep_sending(stop, beat)
    try:
        version = 0
        for step in range(10, 60, 4):  # the honest island's own pace: fragment 0 is due at 4r + 2
            round_index = (step - 2) // 4
            beat = target.honest.heartbeat(0, step, 0.01, schedule_step=step)
            assert beat.run_step <= step + 4 * 4  # the run's clock stays with the honest island
            ack = target.push(target.honest, 0, 0, torch.full((numel,), 1e-3), round=round_index, base_version=version,
                              seq=step, codec="fp32")
            assert not ack.late, (attack, step, ack)
            version = wait_for_version(target.honest.pull, 0, version + 1, timeout=10)[0]
            assert version == ack.version + 1, (attack, step)  # closed by the closer, not stalled
        status = target.honest.status()
        assert status.rounds[0].grace_wait_max_s < 1.0  # the grace window follows the honest step time
        assert status.islands[1].schedule_step < 60 + 4 * 4 + 1000 * 30  # bounded by a rate, not 2**62
    finally:
        stop.set()
        thread.join(5)
