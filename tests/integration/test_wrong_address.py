"""A wrong synchronizer address is named at once: a host that does not resolve fails saying so,
an address that does not answer is said from the first failure on, with how long the island will
keep trying and the setting that bounds it (it was one line at about 14 s, then nothing until
the failure at 311.8 s)."""

import logging
import socket

import pytest

from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS


def test_a_host_that_does_not_resolve_fails_naming_it_not_after_the_join_wait():
    client = SynchronizerClient("no-such-synchronizer.invalid:7470")
    try:
        with pytest.raises(ValueError, match=r"host 'no-such-synchronizer.invalid' .* does not resolve.*DILOCO_SYNCHRONIZER"):
            client.join(0, 1, SPECS, patience=0.0)  # no patience: one lookup (RESOLVE_PATIENCE with a join_wait)
    finally:
        client.close()


def test_an_address_that_does_not_answer_is_said_at_the_first_failure_with_the_time_left_and_its_setting(caplog):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = SynchronizerClient(f"127.0.0.1:{port}", max_retries=0, backoff=0.05, max_backoff=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_diloco.transport.island_link"), \
                pytest.raises(SynchronizerError) as gave_up:
            client.join(0, 1, SPECS, patience=1.0, patience_setting="the strategy's join_wait=1")
    finally:
        client.close()
    assert gave_up.value.reason == Reason.UNREACHABLE
    said = [r.getMessage() for r in caplog.records]
    first = said[0]  # logged after the first attempt, before any backoff
    assert f"no synchronizer reachable at 127.0.0.1:{port} yet (UNAVAILABLE" in first and "tried for 0 s" in first, said
    assert "trying for 1 s more (the strategy's join_wait=1 bounds it)" in first, said
