"""Small shared test fixtures. The tiny layout, its parameters, contributions against it and the fake
clock live in benchmarks/fakes.py (the arena benchmark uses them too) and are re-exported here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from benchmarks.fakes import SPECS, FakeClock, contribution, initial_fragments, layout
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.sparse_codec import CHUNK, chunk_k

__all__ = ["SPECS", "FakeClock", "contribution", "initial_fragments", "layout"]  # (benchmarks/fakes.py's, for the tests)

def run_config(num_fragments=2, min_quorum=1, gamma=0.0, overlap=1, uplink="fp32", downlink="fp32", history=4, **merge):
    return RunConfig(
        schedule=ScheduleConfig(num_fragments=num_fragments, sync_every=4, overlap_steps=overlap),
        merge=MergeConfig(min_quorum=min_quorum, grace_gamma=gamma, history=history, **merge),
        outer=OuterConfig(lr=0.7, momentum=0.9),
        codec=CodecConfig(uplink=uplink, downlink=downlink),
    )


def with_peer_votes(sync, islands) -> None:
    """Make ``sync`` a run past its first rounds: each of ``islands`` has a merged contribution on
    record in every fragment's influence guard, so an entry alone in a round has another island's
    vote to be bounded by and does not wait for a peer's (synchronizer/rounds.py). The votes are so
    large that they bound nothing: the tests that use this are about something else."""
    for fragment in sync.run.fragments.values():
        for island in islands:
            fragment.rounds.guard.record(island, 1e30, 1e30, 1)


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; past ``timeout`` s kill its whole process tree and fail
    with its output. Keep ``timeout`` below the test's own pytest timeout, so this one fires."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])} ... ran past {timeout:.0f} s and was killed; its output:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def sample_setting_value(s):
    """A valid value other than the default, for every kind of setting."""
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.type is bool:
        return not s.default
    if s.name in ("num_fragments", "overlap_steps"):
        return 1
    if s.type is int:
        return s.default + 4  # block_size is a multiple of 4
    if s.name == "sparse_dense_tensors":
        return "lm_head.*"
    return {"grace_gamma": 0.25, "mix_alpha": 0.25, "rebase_keep": 0.5, "outer_momentum": 0.5, "outlier_z": 4.0}.get(s.name, s.default * 2)


COMPANIONS = {"uplink_residual": {"apply": "rebase"}, "sparse_dense_tensors": {"uplink_codec": "sparse"}}
"""What a setting's sample value needs beside it to be valid (core/config.py's cross-checks)."""


def sample_settings(s) -> dict:
    """``{s.name: sample_setting_value(s)}`` and the settings that value needs beside it."""
    return {s.name: sample_setting_value(s), **COMPANIONS.get(s.name, {})}


def wait_for_version(pull, fragment: int, version: int, timeout: float = 30.0) -> tuple[int, torch.Tensor]:
    """``pull(fragment)`` until it returns ``version`` or a later one (a closer merges in the
    background); fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = pull(fragment)
        if got[0] >= version:
            return got
        assert time.monotonic() < deadline, f"fragment {fragment} still at version {got[0]} after {timeout} s, waiting for {version}"
        time.sleep(0.02)


def exit_now() -> None:
    """End a script run by torchrun without the interpreter's teardown, once its results are
    written: gloo's threads are sometimes still joinable when C++'s static destructors run, which
    aborts the process ("terminate called without an active exception", SIGABRT) after a run
    that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def holds_final_global_model(weights: list[torch.Tensor], service, num_fragments: int) -> bool:
    """Whether ``weights`` (an island's tensors) are the synchronizer's current global fragments:
    the same values, compared as sorted multisets (no layout needed; fp32 values of a trained
    model do not coincide by chance)."""
    final = torch.cat([service.pull(p)[1] for p in range(num_fragments)])
    mine = torch.cat([w.detach().reshape(-1).float() for w in weights])
    return final.numel() == mine.numel() and torch.equal(torch.sort(final)[0], torch.sort(mine)[0])


def sparse_payload_with_indices(payload: torch.Tensor, codec, numel: int, index: list[int]) -> torch.Tensor:
    """A sparse ``payload`` with its indices replaced by ``index`` (as many), packed as the layout
    in core/sparse_codec.py says: pairs in three bytes, a zero index padding an odd count."""
    scale_bytes, index_bytes, _ = codec.sections(numel)
    out = payload.clone()
    packed = out[scale_bytes : scale_bytes + index_bytes]
    padded = list(index) + [0] * (index_bytes // 3 * 2 - len(index))
    for p, (a, b) in enumerate(zip(padded[0::2], padded[1::2])):
        packed[3 * p : 3 * p + 3] = torch.tensor([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dtype=torch.uint8)
    return out


def sparse_payload_indices(payload: torch.Tensor, codec, numel: int) -> list[set[int]]:
    """The indices a sparse ``payload`` sends, chunk by chunk, read as the layout says."""
    scale_bytes, index_bytes, _ = codec.sections(numel)
    packed = payload[scale_bytes : scale_bytes + index_bytes].tolist()
    index: list[int] = []
    for p in range(0, len(packed), 3):
        a, b, c = packed[p : p + 3]
        index += [a | (b & 0xF) << 8, b >> 4 | c << 4]
    out, sent = [], 0
    for start in range(0, numel, CHUNK):
        k = chunk_k(min(CHUNK, numel - start), codec.density)
        out.append(set(index[sent : sent + k]))
        sent += k
    return out
