"""``lightning-diloco synchronizer`` and ``status`` as a user runs them: real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version

CLI = [sys.executable, "-m", "lightning_diloco.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def synchronizer_process(tmp_path):
    procs = []

    def start(*extra):
        proc = subprocess.Popen(
            [*CLI, "synchronizer", "--port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        procs.append(proc)
        for line in proc.stdout:
            if line.startswith("synchronizer listening on "):
                return proc, line.split()[-1]
        raise AssertionError(f"synchronizer did not start: exit {proc.wait()}")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def test_synchronizer_command_serves_status_metrics_and_checkpoints_on_sigterm(synchronizer_process, tmp_path):
    metrics_port = _free_port()
    proc, address = synchronizer_process(
        "--num-fragments", "2", "--sync-every", "4", "--overlap-steps", "1", "--uplink-codec", "fp32",
        "--metrics-port", str(metrics_port),
    )
    config = run_config()
    with SynchronizerClient(address) as client:
        info = client.join(0, 1, SPECS)
        assert info.config.schedule.num_fragments == 2 and info.config.codec.uplink == "fp32"
        for p, value in initial_fragments(config).items():
            client.seed(0, p, value)
        numel = layout(config).fragment_numel(0)
        client.push(Contribution(island=0, fragment=0, round=0, base_version=0, tokens=10.0, steps=2, codec="fp32", seq=0,
                    payload=get_codec("fp32").encode(torch.zeros(numel)), layout_hash=info.layout_hash))
        assert wait_for_version(client.pull, 0, 1)[0] == 1  # its closer merged the round

    table = subprocess.run([*CLI, "status", address], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "outer steps 1" in table.stdout and "live islands [0]" in table.stdout

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert "diloco_outer_steps_total 1.0" in metrics and 'diloco_fragment_version{fragment="0"} 1.0' in metrics

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / "ckpt" / "synchronizer-000000000001.pt").exists() and (tmp_path / "ckpt" / "synchronizer.json").exists()

    # a new process resumes where the old one stopped
    proc2, address2 = synchronizer_process("--num-fragments", "2", "--sync-every", "4", "--overlap-steps", "1")
    with SynchronizerClient(address2) as client:
        assert client.join(0, 1, SPECS).versions == {0: 1, 1: 0}
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(timeout=30) == 0


def test_bad_settings_exit_with_a_clear_message():
    result = subprocess.run([*CLI, "synchronizer", "--port", "0", "--min-quorum", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "min_quorum=0 must be >= 1" in result.stderr


def test_an_unwritable_checkpoint_directory_is_refused_at_start(tmp_path):
    (tmp_path / "ckpt").write_text("a file where the folder should be")
    result = subprocess.run([*CLI, "synchronizer", "--port", "0", "--checkpoint-dir", str(tmp_path / "ckpt")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "is not writable" in result.stderr and "--checkpoint-dir" in result.stderr


@pytest.mark.parametrize("flag", ["--port", "--status-port", "--metrics-port"])
def test_a_port_in_use_is_refused_naming_it_without_a_traceback(flag):
    """A second synchronizer started as the docs print it, beside the first, or beside anything
    else on that port: one line that says which port and what to do, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--port", str(port)] if flag == "--port" else ["--port", "0", flag, str(port)]
        result = subprocess.run([*CLI, "synchronizer", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    said = result.stderr.strip().splitlines()[-1]
    assert said.startswith("lightning-diloco synchronizer: error: ") and str(port) in said and "choose" in said, said


def test_status_of_an_address_where_nothing_listens_asks_whether_a_synchronizer_runs_there():
    address = f"127.0.0.1:{_free_port()}"
    result = subprocess.run([*CLI, "status", address], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"is a synchronizer running at {address}?" in result.stderr, result.stderr


def test_status_without_the_token_says_so_without_a_traceback(synchronizer_process, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc, address = synchronizer_process("--token-file", str(token_file))
    assert "s3cret" not in " ".join(proc.args)  # the token is not on the command line
    table = subprocess.run([*CLI, "status", address], capture_output=True, text=True, timeout=60)
    assert table.returncode == 2 and "Traceback" not in table.stderr and "--token-file" in table.stderr
    assert table.stderr.count("pass the run's token") == 1, table.stderr  # the hint once, not twice
    ok = subprocess.run([*CLI, "status", address, "--token-file", str(token_file)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_an_island_credential_printed_by_the_cli_acts_as_that_island_only(synchronizer_process, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("run-secret\n")
    proc, address = synchronizer_process("--num-fragments", "2", "--sync-every", "4", "--token-file", str(token_file))
    printed = subprocess.run([*CLI, "credential", "--island", "2", "--token-file", str(token_file)], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    assert printed.startswith("island-2.") and "run-secret" not in printed
    from lightning_diloco.transport.client import SynchronizerError

    with SynchronizerClient(address, token=printed, max_retries=0) as client:
        assert client.join(2, 1, SPECS).layout_hash
        with pytest.raises(SynchronizerError) as err:
            client.join(3, 1, SPECS)
        assert err.value.reason == "unauthenticated" and "credential --island 3" in str(err.value)
