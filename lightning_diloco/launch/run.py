"""``lightning-diloco run``: a synchronizer and M islands on one host, self-healing, with chaos.

Each island is ``COMMAND`` in its own process tree and clean environment (``DILOCO_*`` set, a
fresh ``MASTER_PORT``, inherited launcher variables removed). An island that exits abnormally is
restarted with backoff, up to ``--max-restarts`` times; it rejoins the run by pulling the global
model. ``--baseline ddp`` runs the same command as one DDP job over M processes instead, restarted
as a whole from its last checkpoint whenever any rank dies: the comparison the paper makes.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_diloco.core.exit_codes import EXIT_REFUSED
from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.launch.chaos import Fault, due_faults, parse_schedule
from lightning_diloco.launch.console import Console, progress_line
from lightning_diloco.launch.environments import free_port, island_environment, synchronizer_command, synchronizer_environment
from lightning_diloco.launch.options import RunOptions
from lightning_diloco.launch.preflight import check_command, exception_line, import_failure
from lightning_diloco.launch.report import RecoveryClock, RunReport, Sample, build_report, rounds_health
from lightning_diloco.launch.supervisor import (
    Supervised,
    UnitState,
    children,
    clean_environment,
    read_progress,
    read_progress_line,
    safe_kill,
)
from lightning_diloco.launch.workdir import checkpoint_folder, progress_file, set_aside

if TYPE_CHECKING:  # imported where used: a run with no synchronizer client needs no grpc
    from lightning_diloco.transport.client import SynchronizerClient

log = logging.getLogger(__name__)
SAMPLE_EVERY = 0.25


class Run:
    def __init__(self, options: RunOptions, command: list[str], observers: Sequence[Callable[[SynchronizerStatus], None]] = ()) -> None:
        self.options, self.command = options, command
        self.observers = list(observers)  # called with each synchronizer status the launcher samples
        # a schedule that cannot be read is refused before an earlier run in --workdir is moved aside
        horizon = options.chaos_horizon
        self.pending: list[Fault] = parse_schedule(options.chaos, num_islands=options.islands, horizon_s=horizon) if options.chaos else []
        self.temporary = options.workdir is None  # a folder nobody else knows of: removed when the run ends
        self.workdir = Path(options.workdir or tempfile.mkdtemp(prefix="diloco-run-"))
        note = set_aside(self.workdir, resume=options.resume) if options.workdir else None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ddp = options.baseline == "ddp"
        self.units = 1 if self.ddp else options.islands  # supervised process trees
        self.fired: list[str] = []
        self.synchronizer_downs: list[float] = []  # run times at which the synchronizer went away
        self._sync_reachable = True
        self._timers: list[threading.Timer] = []
        self.samples: list[Sample] = []
        self.recovery = RecoveryClock()
        self.last_status: SynchronizerStatus | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # samples, synchronizer_downs and recovery: the loop and the sampler share them
        self._sampling_done = threading.Event()
        self._sampler: threading.Thread | None = None
        self.synchronizer: Supervised | None = None
        self.address = options.synchronizer
        self.token = options.token
        self.client: SynchronizerClient | None = None
        self._write = threading.Lock()
        self.failures: list[str] = []  # why units failed, for the run's last line
        self._world_size_said: set[int] = set()  # islands whose wrong process count was said
        self.console = Console(self.echo, self.workdir, options.progress_every)
        self._next_progress = float("inf")
        if note:
            self.echo(note)

    def echo(self, line: str) -> None:
        with self._write:
            sys.stdout.write(line)
            sys.stdout.flush()

    # ---- processes ------------------------------------------------------------------------------

    def _start_synchronizer(self) -> str:
        """Start the run's own synchronizer; returns the address it serves."""
        port = free_port()
        self.synchronizer = Supervised("synchronizer", synchronizer_command(self.options, self.workdir, port),
                                       lambda: synchronizer_environment(self.token), self.console.output_of("synchronizer"))
        self.synchronizer.start()
        return f"127.0.0.1:{port}"

    def start(self) -> None:
        if not self.ddp:
            if self.address is None:
                self.address = self._start_synchronizer()
            from lightning_diloco.transport.client import SynchronizerClient

            self.client = SynchronizerClient(self.address, token=self.token, max_retries=0, timeout=2.0)
        names = ["ddp-job"] if self.ddp else [f"island {i}" for i in range(self.units)]
        self.islands = [Supervised(names[i], self.command,  # a fresh environment (MASTER_PORT) at each start
                                   lambda i=i: island_environment(self.options, i, self.workdir, self.address),  # type: ignore[misc]  # i=i binds the index
                                   self.console.output_of(names[i]))
                        for i in range(self.units)]
        if self.console.quiet:
            self.echo(f"[launcher] {len(names)} {'DDP job' if self.ddp else 'islands'}: each one's output in "
                      f"{self.console.log_path('island 0').parent}/*.log; progress every {self.options.progress_every:g}s\n")
            self._next_progress = time.monotonic() + self.options.progress_every
        self.t0 = time.monotonic()
        for i, island in enumerate(self.islands):
            if self.ddp or not self.options.stagger or i == 0:
                island.start()
            else:  # island i starts i x stagger seconds after the first (the loop starts it)
                island.wait_until(self.t0 + i * self.options.stagger)

    # ---- faults ----------------------------------------------------------------------------------

    def _rank_pid(self, rank: int) -> int | None:
        """PID of rank ``rank`` of the DDP job: the top process is rank 0, the others its children."""
        top = self.islands[0].proc
        if top is None:  # the job has not started: no rank to fault
            return None
        if rank == 0:
            return top.pid
        for child in children(top.pid):
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
            if self.synchronizer is not None and self.synchronizer.kill():
                with self._lock:
                    self._synchronizer_went_down(now)
            return
        assert fault.island is not None  # parse_schedule gives every fault but kill-synchronizer an island
        if self.ddp:
            pid = self._rank_pid(fault.island)
            if pid is None:
                return
            if fault.kind == "kill":
                # The surviving ranks would block in their next collective until the process
                # group times out; a job with checkpoint-restart is torn down and restarted whole.
                safe_kill(pid, signal.SIGKILL)
                self.islands[0].kill()
            else:
                safe_kill(pid, signal.SIGSTOP)
                self._timers.append(threading.Timer(fault.duration_s, safe_kill, args=(pid, signal.SIGCONT)))
                self._timers[-1].start()
            return
        island = self.islands[fault.island]
        done = island.kill(fault.duration_s) if fault.kind == "kill" else island.pause(now + fault.duration_s)
        if not done:
            self.echo(f"[chaos] {island.name} is {island.state.value}: nothing to {fault.kind}\n")

    # ---- the loop ------------------------------------------------------------------------------

    def _unit_index(self, island: int) -> int:
        """The process tree that runs ``island``: its own, or the one DDP job of the baseline."""
        return 0 if self.ddp else island

    def _unit(self, island: int) -> Supervised:
        return self.islands[self._unit_index(island)]

    def _sample_until_done(self) -> None:
        """The sampler thread: a status call can take its whole timeout while the synchronizer is
        down, and faults, restarts and resumes must not wait for it."""
        while True:
            self._sample(time.monotonic())
            if self._sampling_done.wait(SAMPLE_EVERY):
                return

    def _sample(self, now: float) -> None:
        files = {i: progress_file(self.workdir, self._unit_index(i)) for i in range(self.options.islands)}
        steps = {i: read_progress(f) for i, f in files.items()}
        alive = {i for i in range(self.options.islands) if self._unit(i).alive}
        status = None
        if self.client is not None:  # (None: the DDP baseline has no synchronizer)
            try:
                status = self.client.status()
            except Exception:  # noqa: BLE001 - the synchronizer is down: its own restart window
                pass
        with self._lock:
            if self.ddp:
                progress = steps.get(0, 0)
            elif status is None:
                progress = self.samples[-1].global_progress if self.samples else 0
                self._synchronizer_went_down(now)
            else:
                progress = status.outer_steps
                for i, f in files.items():  # a script without the ProgressFile callback: its heartbeats say
                    if not f.exists() and i in status.islands:
                        steps[i] = status.islands[i].steps
                self.recovery.observe(status, now)
                self.last_status = status
                self._check_world_sizes(status)
                self._sync_reachable = True
            self.samples.append(Sample(now - self.t0, progress, steps, alive))
        if status is not None:
            for observe in self.observers:
                observe(status)

    def _check_world_sizes(self, status: SynchronizerStatus) -> None:
        """An island that joined with another process count than --devices-per-island: its script
        does not pass DILOCO_DEVICES to the Trainer. Said once per island."""
        for i, island in status.islands.items():
            if island.world_size != self.options.devices_per_island and i not in self._world_size_said:
                self._world_size_said.add(i)
                self.echo(f"[launcher] island {i} joined with {island.world_size} process(es), not --devices-per-island="
                          f"{self.options.devices_per_island}: its script ignores DILOCO_DEVICES; pass "
                          "devices=int(os.environ['DILOCO_DEVICES']) to its Trainer\n")

    def _synchronizer_went_down(self, now: float) -> None:
        """Called with ``_lock`` held."""
        if self._sync_reachable:
            self._sync_reachable = False
            self.synchronizer_downs.append(now - self.t0)

    def _handle_exits(self, now: float) -> None:
        for island in self.islands:
            code = island.poll()
            if code is not None and not island.done:
                self._exited(island, code, now)
        for index, island in enumerate(self.islands):
            if island.state is UnitState.WAITING and island.due is not None and now >= island.due:
                first = island.proc is None
                island.start()
                if first:  # a staggered start
                    continue
                island.restarts += 1
                self.echo(f"[launcher] restarted {island.name} (restart {island.restarts})\n")
                if not self.ddp:  # a recovery counts from the moment the island went down
                    with self._lock:
                        self.recovery.island_restarted(index, island.lifetimes[-2][1] or now, now)
                    note = without_checkpoint(island.name, checkpoint_folder(self.workdir, index))
                    if note:
                        self.echo(note)
            elif island.state is UnitState.PAUSED and island.due is not None and now >= island.due:
                island.resume()
        if self.synchronizer is not None and self.synchronizer.poll() is not None and not self._stop.is_set():
            self.echo("[launcher] synchronizer exited; restarting it from its checkpoint\n")
            self.synchronizer.wait_until(now)
            self.synchronizer.start()  # same port, same checkpoint folder

    def _exited(self, island: Supervised, code: int, now: float) -> None:
        """What follows an island's exit: finished, failed for good, or a restart after a delay."""
        killed = island.state is UnitState.KILLED
        if code != 0 and not killed and self.console.quiet:  # its output went to its log: show how it ended
            tail = "".join(f"[{island.name}] {line}\n" for line in list(island.last_lines)[-5:])
            self.echo(f"[launcher] {island.name} exited with {code}; the end of {self.console.log_path(island.name)}:\n{tail}")
        if code == 0 and not killed:
            island.finish()
            self.echo(f"[launcher] {island.name} finished\n")
        elif code == EXIT_REFUSED:  # a restart would be refused the same way
            why = next((line for line in reversed(island.last_lines) if "refused" in line), "see its output above")
            self._stop_run(island, f"{island.name} was refused by the synchronizer: {why}")
        elif (missing := import_failure(island.last_lines)) is not None:  # a restart would crash the same way
            self._stop_run(island, f"{island.name} cannot start: {missing}; install it into the Python the command runs "
                                   f"(this launcher's is {sys.executable})")
        elif not killed and (repeated := self._failed_again_before_stepping(island, code)) is not None:
            # a bug in the set-up, not a crash: a restart would fail the same way again
            self._stop_run(island, f"{island.name} failed the same way twice before its first training step ({repeated}); "
                                   "a restart would fail again: fix what its output above says")
        elif island.restarts >= self.options.max_restarts:
            island.fail()
            last = next((line for line in reversed(island.last_lines) if line.strip()), None)
            self.failures.append(f"{island.name} exited with {code} and used up its {self.options.max_restarts} restarts"
                                 + (f"; its last output: {last.strip()}" if last else ""))
            self.echo(f"[launcher] {self.failures[-1]}\n")
        else:
            delay = island.hold_s if killed else min(self.options.restart_backoff * 2 ** island.restarts, 30.0)
            island.wait_until(now + delay)
            if self.ddp:
                island.signal(signal.SIGKILL)  # one rank died: the whole job goes down and restarts

    def _stop_run(self, island: Supervised, failure: str) -> None:
        """``island`` fails for good, and so does the run: every island runs the same command, so
        the others would fail the same way."""
        island.fail()
        self.failures.append(failure)
        self.echo(f"[launcher] {failure}; not restarting it, stopping the run\n")
        self._stop.set()

    def _failed_again_before_stepping(self, island: Supervised, code: int) -> str | None:
        """How ``island`` failed, when its process and the one before it both failed that way
        (exit code and exception line) before their first training step, else None. A step is
        its progress file written (``ProgressFile``); a script without one counts as never having
        stepped, so an identical crash twice in a row stops it wherever it happens."""
        exception = exception_line(island.last_lines)
        before = island.early_failure
        failure = f"exit {code}: {exception}" if exception else None
        island.early_failure = None if island.stepped(progress_file(self.workdir, self.islands.index(island))) else failure
        return failure if failure is not None and failure == before else None

    def loop(self) -> int:
        self._sampler = threading.Thread(target=self._sample_until_done, name="diloco-launch-sampler", daemon=True)
        self._sampler.start()
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                steps = self.samples[-1].steps if self.samples else {}
            for fault in due_faults(self.pending, now - self.t0, steps):
                self.pending.remove(fault)
                self._fire(fault, now)
            self._handle_exits(now)
            if all(i.done for i in self.islands):
                break
            if now >= self._next_progress:
                self._next_progress = now + self.options.progress_every
                self._print_progress(now)
            self._stop.wait(0.05)
        return 1 if any(i.state is UnitState.FAILED for i in self.islands) or self._stop.is_set() else 0

    def _print_progress(self, now: float) -> None:
        files = [progress_file(self.workdir, i) for i in range(self.units)]
        progress = {i: read_progress_line(f) for i, f in enumerate(files)}
        activity = {i: unit.activity(f) for i, (unit, f) in enumerate(zip(self.islands, files))}
        self.echo(progress_line(now - self.t0, progress, activity, self.last_status, "DDP job" if self.ddp else "island"))

    def shutdown(self) -> None:
        self._sampling_done.set()
        if self._sampler is not None:
            self._sampler.join()  # its status call is bounded by the client's timeout
        for timer in self._timers:
            timer.cancel()
        for island in self.islands:
            island.stop()
        if self.client is not None:
            self.client.close()
        if self.synchronizer is not None:
            self.synchronizer.stop()
        self.console.close()

    def report(self) -> RunReport:
        now = time.monotonic()
        method = "ddp checkpoint-restart" if self.ddp else "decoupled diloco"
        alive = {i: self._unit(i).alive_seconds(now) for i in range(self.options.islands)}
        finished = [i for i in range(self.options.islands) if self._unit(i).state is UnitState.FINISHED]
        failures = list(self.failures)
        if self._stop.is_set() and not failures and not all(island.done for island in self.islands):
            failures.append("stopped before every island finished (interrupted)")
        with self._lock:
            rep = build_report(method, self.options.islands, self.samples, alive, rollback_steps=self.ddp,
                               synchronizer_restarts=self.synchronizer_downs, finished=finished,
                               ended_at=now - self.t0, failures=failures)
            rep.recoveries_s = list(self.recovery.recoveries)
            rep.unrecovered = self.recovery.unrecovered
            rep.accepted = dict(self.recovery.accepted)
            if self.last_status is not None:
                rep.rounds = rounds_health(self.last_status)
        rep.faults = self.fired
        rep.restarts = {i: self._unit(i).restarts for i in range(self.options.islands)}
        return rep


def without_checkpoint(name: str, folder: Path) -> str | None:
    """What to tell the user when a restarted island finds no checkpoint of its own to resume from."""
    if folder.is_dir() and any(folder.iterdir()):
        return None
    return (f"[launcher] {name} left no checkpoint in $DILOCO_CHECKPOINT_DIR ({folder}): it rejoins from the global "
            "model but trains its whole step count again; save Lightning checkpoints there to resume "
            "(examples/train_lm.py shows how)\n")


def run(options: RunOptions, command: list[str], observers: Sequence[Callable[[SynchronizerStatus], None]] = ()) -> int:
    """Run ``command`` as the islands of ``options`` until every island is done; print the run
    report (and write it to ``options.report``). ``observers`` are called with each synchronizer
    status the launcher samples. Returns the exit code: 0 when every island finished."""
    if not command:
        raise ValueError("give the training command after --, e.g. "
                         "lightning-diloco run --islands 2 -- python examples/train_lm.py --steps 48")
    check_command(command, clean_environment({}))
    replaces = bool(options.report and Path(options.report).exists())
    if options.report:  # its folder now, not after the whole run
        Path(options.report).parent.mkdir(parents=True, exist_ok=True)
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
    if report.failed:
        print("run failed: " + "; ".join(report.failures), flush=True)
    if options.report:
        Path(options.report).write_text(json.dumps(report.to_dict(), indent=2, default=sorted))
        print(f"[launcher] report written to {options.report}" + (", replacing an earlier run's" if replaces else ""), flush=True)
    if launcher.temporary:  # its checkpoints and progress files: keep them with --workdir
        shutil.rmtree(launcher.workdir, ignore_errors=True)
    return code
