"""SIGKILL under load, then restart: no version a client was given is lost (checkpointed or not:
the version log, synchronizer/version_log.py), the clients carry on (a real process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.reasons import Reason
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, initial_fragments, layout, run_config

pytestmark = pytest.mark.slow
CLIENTS = 16


def _start(ckpt, port="0", output=None):
    """Start a synchronizer; its output lines go into ``output`` (kept for the failure message)."""
    output = [] if output is None else output
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--port", port, "--checkpoint-dir", str(ckpt),
         "--checkpoint-every", "1", "--num-fragments", "2", "--sync-every", "4", "--overlap-steps", "1",
         "--uplink-codec", "fp32", "--downlink-codec", "fp32", "--liveness-timeout", "5", "--recovery-wait", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    for line in proc.stdout:
        output.append(line)
        if line.startswith("synchronizer listening on "):
            threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()  # keep the pipe drained
            return proc, line.split()[-1]
    raise AssertionError(f"synchronizer did not start: exit {proc.wait()}:\n{''.join(output[-40:])}")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.timeout(240)
def test_sigkill_under_load_loses_no_version_handed_out_and_clients_carry_on(tmp_path):
    config = run_config(num_fragments=2)
    numel = [layout(config).fragment_numel(p) for p in range(2)]
    proc, address = _start(tmp_path)
    port = address.rsplit(":", 1)[1]
    stop = threading.Event()
    acks, errors = [0] * CLIENTS, []
    pulled = [0, 0]  # per fragment, the highest version a client was given
    clients = [SynchronizerClient(address, max_retries=40, backoff=0.05, max_backoff=0.5) for _ in range(CLIENTS)]
    try:
        clients[0].join(0, 1, SPECS)
        for p, value in initial_fragments(config).items():
            clients[0].seed(0, p, value)

        def load(i):
            # Sends for the round after the version it pulled, or the round the synchronizer last
            # named if that is later: a restart that lost versions keeps the rounds it had named
            # (a real island sends for the round its steps reach, never below the clock).
            client, seq, named, held = clients[i], 0, 0, None
            if i:
                client.join(i, 1, SPECS)
            while not stop.is_set():
                p = i % 2
                try:
                    version, held = client.pull(p)
                    pulled[p] = max(pulled[p], version)
                    seq += 1
                    ack = client.push(Contribution(island=i, fragment=p, round=max(version + 1, named), base_version=version,
                                      tokens=100.0, steps=4, codec="fp32", seq=seq,
                                      payload=get_codec("fp32").encode(torch.full((numel[p],), 1e-3)),
                                      layout_hash=layout(config).hash))
                    named = ack.round + (0 if ack.late else 1)
                    acks[i] += 1
                except Exception as err:  # noqa: BLE001 - counted; a push may meet the kill
                    if not stop.is_set():
                        errors.append(type(err).__name__)
                    try:
                        if client.shard_sessions.absent(0):  # it gave up on a slow restart: join again
                            client.join(i, 1, SPECS, patience=60)
                        elif getattr(err, "reason", None) == Reason.NOT_SEEDED and held is not None:
                            client.seed(i, p, held)  # the restarted one waits for a version it published: give it back
                    except Exception as again:  # noqa: BLE001 - counted, tried again at the next send
                        errors.append(type(again).__name__)

        threads = [threading.Thread(target=load, args=(i,), name=f"diloco-test-load-{i}") for i in range(CLIENTS)]
        for t in threads:
            t.start()
        rss = []
        for _ in range(8):  # the synchronizer's memory under load: it must level off, not grow per round
            time.sleep(0.5)
            rss.append(_rss_mb(proc.pid))
        before = clients[0].status()
        _kill(proc)
        handed_out = list(pulled)
        on_disk = json.loads((tmp_path / "synchronizer.json").read_text())
        acks_at_kill = sum(acks)
        output = []
        proc, _ = _start(tmp_path, port, output)  # same port: the clients reconnect by themselves
        with SynchronizerClient(address) as watcher:
            deadline = time.monotonic() + 50  # below --recovery-wait: served again by the clients, not the fallback
            while min((restarted := watcher.status()).versions.values()) < 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        said = "".join(output[-40:])
        # no version handed out is lost: each fragment is served at the last one a client pulled, or later
        assert all(restarted.versions[p] >= handed_out[p] for p in range(2)), f"{restarted.versions} {handed_out}\n{said}"
        assert restarted.outer_steps >= on_disk["outer_steps"] > 0
        lost = before.outer_steps - restarted.outer_steps
        print(f"\n[crash] {CLIENTS} clients, {acks_at_kill} contributions acked before the kill, versions pulled "
              f"{handed_out}, outer steps seen {before.outer_steps}, on disk {on_disk['outer_steps']}, served again at "
              f"{restarted.versions} ({restarted.outer_steps} outer steps) "
              f"(lost {max(0, lost)}), errors while it was down {len(errors)}, synchronizer RSS over the load (MB) "
              f"{[round(r) for r in rss]}")
        assert rss[-1] < rss[1] * 1.5 + 50  # a plateau, not a climb
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(60)
        final = clients[0].status()
        said = "".join(output[-40:])
        # the clients carried on against the new process
        assert final.outer_steps > restarted.outer_steps, f"{final}\nthe restarted synchronizer said:\n{said}"
        assert sum(acks) > acks_at_kill
        assert all(torch.isfinite(clients[0].pull(p)[1]).all() for p in range(2))
    finally:
        stop.set()
        for c in clients:
            c.close()
        _kill(proc)
