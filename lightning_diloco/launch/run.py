"""``lightning-diloco run``: a synchronizer and M islands on one host, self-healing, with chaos.

Each island is ``COMMAND`` in its own process tree and clean environment (``DILOCO_*`` set, a
fresh ``MASTER_PORT``, inherited launcher variables removed). An island that exits abnormally is
restarted with backoff, up to ``--max-restarts`` times; it rejoins the run by pulling the global
model. ``--baseline ddp`` runs the same command as one DDP job over M processes instead, restarted
as a whole from its last checkpoint whenever any rank dies: the comparison the paper makes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from lightning_diloco.core.config import RunConfig
from lightning_diloco.launch.chaos import Fault, due_faults, parse_schedule
from lightning_diloco.launch.report import RecoveryClock, RunReport, Sample, build_report
from lightning_diloco.launch.supervisor import EXIT_REFUSED, Supervised, clean_environment, read_progress
from lightning_diloco.synchronizer.main import add_token_arguments, resolve_token

log = logging.getLogger(__name__)
SAMPLE_EVERY = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(kw_only=True)
class RunOptions:
    """What ``lightning-diloco run`` takes, for callers in Python (recipes, benchmarks): each
    field is the flag of the same name (``add_run_arguments``), with the same default."""

    islands: int = 2
    devices_per_island: int = 1
    synchronizer: str | None = None
    """Join this synchronizer (host:port[,...]) instead of starting one."""
    token: str | None = None
    chaos: str | None = None
    chaos_horizon: float = 3600.0
    report: str | None = None
    max_restarts: int = 5
    restart_backoff: float = 1.0
    stagger: float = 0.0
    liveness_timeout: float = 5.0
    checkpoint_every: int = 1
    baseline: str | None = None
    workdir: str | None = None
    run_config: RunConfig | None = None
    """The started synchronizer's run settings (passed as ``--config``); None: the defaults."""
    synchronizer_args: list[str] = field(default_factory=list)
    """More arguments for the started synchronizer, e.g. ``["--status-port=8080"]``."""

    def __post_init__(self) -> None:
        if self.islands < 1 or self.devices_per_island < 1:
            raise ValueError(f"--islands={self.islands} and --devices-per-island={self.devices_per_island} must be >= 1")
        if self.baseline not in (None, "ddp"):
            raise ValueError(f"baseline={self.baseline!r}: the only baseline is 'ddp'")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("token", "run_config")]
        return cls(**{name: getattr(args, name) for name in names}, token=resolve_token(args))


class Run:
    def __init__(self, options: RunOptions, command: list[str], observers: Sequence[Callable[[dict], None]] = ()) -> None:
        self.options, self.command = options, command
        self.observers = list(observers)  # called with each synchronizer status the launcher samples
        self.workdir = Path(options.workdir or tempfile.mkdtemp(prefix="diloco-run-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ddp = options.baseline == "ddp"
        self.units = 1 if self.ddp else options.islands  # supervised process trees
        horizon = options.chaos_horizon
        self.pending: list[Fault] = parse_schedule(options.chaos, num_islands=options.islands, horizon_s=horizon) if options.chaos else []
        self.fired: list[str] = []
        self.synchronizer_downs: list[float] = []  # run times at which the synchronizer went away
        self._sync_reachable = True
        self._timers: list[threading.Timer] = []
        self.samples: list[Sample] = []
        self.recovery = RecoveryClock()
        self._stop = threading.Event()
        self.synchronizer: Supervised | None = None
        self.address = options.synchronizer
        self.token = options.token
        self.client = None
        self._write = threading.Lock()
        self.failures: list[str] = []  # why units failed, for the run's last line

    def echo(self, line: str) -> None:
        with self._write:
            sys.stdout.write(line)
            sys.stdout.flush()

    # ---- processes ------------------------------------------------------------------------------

    def _start_synchronizer(self) -> None:
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--port", str(port),
               "--checkpoint-dir", str(self.workdir / "synchronizer"), "--checkpoint-every", str(self.options.checkpoint_every),
               "--liveness-timeout", str(self.options.liveness_timeout)]
        if self.options.run_config is not None:
            config = self.workdir / "run-config.json"
            config.write_text(json.dumps(self.options.run_config.to_dict(), indent=2))
            cmd += ["--config", str(config)]
        cmd += self.options.synchronizer_args
        # the token goes by environment, never on a command line (the process list shows those)
        env = {"OMP_NUM_THREADS": "1", **({"DILOCO_TOKEN": self.token} if self.token else {})}
        self.synchronizer = Supervised("synchronizer", cmd, lambda: clean_environment(env), self.echo)
        self.synchronizer.start()

    def _island_env(self, i: int) -> dict[str, str]:
        extra = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "DILOCO_NUM_ISLANDS": str(self.options.islands),
            "DILOCO_DEVICES": str(self.options.devices_per_island * (self.options.islands if self.ddp else 1)),
            "DILOCO_PROGRESS_FILE": str(self.workdir / f"progress-{i}.txt"),
            "DILOCO_CHECKPOINT_DIR": str(self.workdir / f"checkpoints-{i}"),
        }
        if "OMP_NUM_THREADS" not in os.environ:
            # Every island process shares this host's cores. Left unset, Lightning gives each
            # process cores // its own world size threads, so M one-process islands ran M times
            # too many OpenMP threads, spinning against each other (measured: 4 islands on 2
            # cores trained 5x slower).
            processes = self.options.islands * self.options.devices_per_island
            extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
        if self.ddp:
            extra["DILOCO_STRATEGY"] = "ddp"
        else:
            extra.update(DILOCO_STRATEGY="decoupled_diloco", DILOCO_ISLAND=str(i), DILOCO_SYNCHRONIZER=self.address)
            if self.token:
                extra["DILOCO_TOKEN"] = self.token
        return clean_environment(extra)

    def start(self) -> None:
        if not self.ddp and self.address is None:
            self._start_synchronizer()
        if not self.ddp:
            from lightning_diloco.transport.client import SynchronizerClient

            self.client = SynchronizerClient(self.address, token=self.token, max_retries=0, timeout=2.0)
        names = ["ddp-job"] if self.ddp else [f"island {i}" for i in range(self.units)]
        self.islands = [Supervised(names[i], self.command, lambda i=i: self._island_env(i), self.echo) for i in range(self.units)]
        self.t0 = time.monotonic()
        for i, island in enumerate(self.islands):
            if self.ddp or not self.options.stagger or i == 0:
                island.start()
            else:  # island i starts i x stagger seconds after the first (the loop starts it)
                island.restart_at = self.t0 + i * self.options.stagger

    # ---- faults ----------------------------------------------------------------------------------

    def _rank_pid(self, rank: int) -> int | None:
        """PID of rank ``rank`` of the DDP job: the top process is rank 0, the others its children."""
        top = self.islands[0].proc
        if rank == 0:
            return top.pid
        for child in _children(top.pid):
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"LOCAL_RANK={rank}".encode() in env:
                return child
        return None

    def _fire(self, fault: Fault, now: float) -> None:
        self.fired.append(f"{fault.describe()} (fired at {now - self.t0:.1f}s)")
        self.echo(f"[chaos] {fault.describe()}\n")
        if fault.kind == "kill-synchronizer":
            if self.synchronizer is not None:
                self.synchronizer.expected_exit = True
                self.synchronizer.signal(signal.SIGKILL)
                self._synchronizer_went_down(now)
            return
        if self.ddp:
            pid = self._rank_pid(fault.island)
            if pid is None:
                return
            if fault.kind == "kill":
                # The surviving ranks would block in their next collective until the process
                # group times out; a job with checkpoint-restart is torn down and restarted whole.
                _safe_kill(pid, signal.SIGKILL)
                self.islands[0].expected_exit = True
                self.islands[0].signal(signal.SIGKILL)
            else:
                _safe_kill(pid, signal.SIGSTOP)
                self._timers.append(threading.Timer(fault.duration_s, _safe_kill, args=(pid, signal.SIGCONT)))
                self._timers[-1].start()
            return
        island = self.islands[fault.island]
        if fault.kind == "kill":
            island.expected_exit = True
            island.hold_s = fault.duration_s
            island.signal(signal.SIGKILL)
        else:
            island.signal(signal.SIGSTOP)
            island.paused_until = now + fault.duration_s

    # ---- the loop ------------------------------------------------------------------------------

    def _sample(self, now: float) -> None:
        files = {i: self.workdir / f"progress-{0 if self.ddp else i}.txt" for i in range(self.options.islands)}
        steps = {i: read_progress(f) for i, f in files.items()}
        alive = {i for i in range(self.options.islands) if self.islands[0 if self.ddp else i].alive}
        if self.ddp:
            progress = steps.get(0, 0)
        else:
            try:
                status = self.client.status()
                progress = status["outer_steps"]
                for i, f in files.items():  # a script without the ProgressFile callback: its heartbeats say
                    if not f.exists() and str(i) in status["islands"]:
                        steps[i] = status["islands"][str(i)]["steps"]
                for observe in self.observers:
                    observe(status)
                self.recovery.observe(status, now)
                self._sync_reachable = True
            except Exception:  # noqa: BLE001 - the synchronizer is down: its own restart window
                progress = self.samples[-1].global_progress if self.samples else 0
                self._synchronizer_went_down(now)
        self.samples.append(Sample(now - self.t0, progress, steps, alive))

    def _synchronizer_went_down(self, now: float) -> None:
        if self._sync_reachable:
            self._sync_reachable = False
            self.synchronizer_downs.append(now - self.t0)

    def _handle_exits(self, now: float) -> None:
        for index, island in enumerate(self.islands):
            code = island.poll()
            if code is None or island.done:
                continue
            if code == 0 and not island.expected_exit:
                island.done = True
                island.finished_at = now - self.t0
                self.echo(f"[launcher] {island.name} finished\n")
                continue
            if code == EXIT_REFUSED:  # a restart would be refused the same way
                island.failed = island.done = True
                why = next((line for line in reversed(island.last_lines) if "refused" in line), "see its output above")
                self.failures.append(f"{island.name} was refused by the synchronizer: {why}")
                self.echo(f"[launcher] {self.failures[-1]}; not restarting it, stopping the run\n")
                self._stop.set()  # every island runs the same command: the others would be refused too
                continue
            if island.restarts >= self.options.max_restarts:
                island.failed = island.done = True
                self.failures.append(f"{island.name} exited with {code} and used up its {self.options.max_restarts} restarts")
                self.echo(f"[launcher] {self.failures[-1]}\n")
                continue
            delay = island.hold_s if island.expected_exit else min(self.options.restart_backoff * 2 ** island.restarts, 30.0)
            island.restart_at = now + delay
            island.expected_exit, island.hold_s = False, 0.0
            if self.ddp:
                island.signal(signal.SIGKILL)  # one rank died: the whole job goes down and restarts
        for index, island in enumerate(self.islands):
            if island.restart_at is not None and now >= island.restart_at:
                island.restart_at = None
                first = island.proc is None
                island.start()
                if first:  # a staggered start
                    continue
                island.restarts += 1
                self.echo(f"[launcher] restarted {island.name} (restart {island.restarts})\n")
                if not self.ddp:  # a recovery counts from the moment the island went down
                    self.recovery.island_restarted(index, island.lifetimes[-2][1] or now)
                    note = without_checkpoint(island.name, self.workdir / f"checkpoints-{index}")
                    if note:
                        self.echo(note)
            if island.paused_until is not None and now >= island.paused_until:
                island.paused_until = None
                island.signal(signal.SIGCONT)
        if self.synchronizer is not None and self.synchronizer.poll() is not None and not self._stop.is_set():
            self.echo("[launcher] synchronizer exited; restarting it from its checkpoint\n")
            self.synchronizer.expected_exit = False
            self.synchronizer.start()  # same port, same checkpoint folder

    def loop(self) -> int:
        next_sample = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            elapsed = now - self.t0
            steps = self.samples[-1].steps if self.samples else {}
            for fault in due_faults(self.pending, elapsed, steps):
                self.pending.remove(fault)
                self._fire(fault, now)
            self._handle_exits(now)
            if now >= next_sample:
                self._sample(now)
                next_sample = now + SAMPLE_EVERY
            if all(i.done for i in self.islands):
                break
            self._stop.wait(0.05)
        return 1 if any(i.failed for i in self.islands) or self._stop.is_set() else 0

    def shutdown(self) -> None:
        for timer in self._timers:
            timer.cancel()
        for island in self.islands:
            island.stop()
        if self.client is not None:
            self.client.close()
        if self.synchronizer is not None:
            self.synchronizer.stop()

    def _finished_at(self) -> dict[int, float]:
        units = {i: self.islands[0 if self.ddp else i] for i in range(self.options.islands)}
        return {i: unit.finished_at for i, unit in units.items() if unit.finished_at is not None}

    def report(self) -> RunReport:
        now = time.monotonic()
        method = "ddp checkpoint-restart" if self.ddp else "decoupled diloco"
        alive = {i: self.islands[0 if self.ddp else i].alive_seconds(now) for i in range(self.options.islands)}
        rep = build_report(method, self.options.islands, self.samples, alive, rollback_steps=self.ddp,
                           synchronizer_restarts=self.synchronizer_downs,
                           finished_at=self._finished_at())
        rep.faults = self.fired
        rep.restarts = {i: self.islands[0 if self.ddp else i].restarts for i in range(self.options.islands)}
        rep.recoveries_s = self.recovery.recoveries
        rep.accepted = dict(self.recovery.accepted)
        return rep


def without_checkpoint(name: str, folder: Path) -> str | None:
    """What to tell the user when a restarted island finds no checkpoint of its own to resume from."""
    if folder.is_dir() and any(folder.iterdir()):
        return None
    return (f"[launcher] {name} left no checkpoint in $DILOCO_CHECKPOINT_DIR ({folder}): it rejoins from the global "
            "model but trains its whole step count again; save Lightning checkpoints there to resume "
            "(examples/train_lm.py shows how)\n")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _safe_kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``lightning-diloco run``; ``RunOptions.from_args`` reads them."""
    d = RunOptions()
    parser.add_argument("--islands", type=int, default=d.islands, help="M, learner islands (default %(default)s)")
    parser.add_argument("--devices-per-island", type=int, default=d.devices_per_island, help="DDP processes per island (DILOCO_DEVICES)")
    parser.add_argument("--synchronizer", help="use this synchronizer (host:port[,...]) instead of starting one")
    add_token_arguments(parser, "run's shared secret")
    parser.add_argument("--chaos", help="fault schedule, e.g. 'kill 1 at 20s; pause 2 at 30s for 5s' or @FILE")
    parser.add_argument("--chaos-horizon", type=float, default=d.chaos_horizon, help="seconds over which random faults are drawn")
    parser.add_argument("--report", help="write the run report as JSON here")
    parser.add_argument("--max-restarts", type=int, default=d.max_restarts, help="restarts per island before the run fails")
    parser.add_argument("--restart-backoff", type=float, default=d.restart_backoff, help="first restart delay after a crash, doubling")
    parser.add_argument("--stagger", type=float, default=d.stagger,
                        help="start island i i x this many seconds after island 0 (islands out of phase, as on a real cluster)")
    parser.add_argument("--liveness-timeout", type=float, default=d.liveness_timeout, help="synchronizer: seconds of silence before an island is not waited for")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help="synchronizer: outer steps between checkpoints; a killed synchronizer loses at most this many - 1")
    parser.add_argument("--baseline", choices=["ddp"], help="run COMMAND as one DDP job with checkpoint-restart instead")
    parser.add_argument("--workdir", help="progress files, checkpoints and synchronizer state (default: a temporary folder)")
    parser.add_argument("--sync", dest="synchronizer_args", action="append", default=[], metavar="ARG",
                        help="pass ARG to the synchronizer, e.g. --sync=--min-quorum=2 or --sync=--config=run.json (repeatable)")


def run(options: RunOptions, command: list[str], observers: Sequence[Callable[[dict], None]] = ()) -> int:
    """Run ``command`` as the islands of ``options`` until every island is done; print the run
    report (and write it to ``options.report``). ``observers`` are called with each synchronizer
    status the launcher samples. Returns the exit code: 0 when every island finished."""
    if not command:
        raise ValueError("give the training command after --, e.g. lightning-diloco run --islands 2 -- python train.py")
    launcher = Run(options, command, observers)
    previous = {sig: signal.signal(sig, lambda *_: launcher._stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        launcher.start()
        code = launcher.loop()
    finally:
        launcher.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report = launcher.report()
    print("\n" + report.summary(), flush=True)
    if launcher.failures:
        print("run failed: " + "; ".join(launcher.failures), flush=True)
    if options.report:
        Path(options.report).write_text(json.dumps(report.to_dict(), indent=2, default=sorted))
    return code
