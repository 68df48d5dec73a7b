"""Background work on the virtual clock: real threads that take turns with the event queue.

An island's leader pushes on its executor: a job forms and encodes the push, then blocks in the
link's push until the synchronizer answers. :class:`TurnExecutor` runs each job on a thread of its
own, but only while the clock's thread waits for it: ``submit`` returns once the job has ended or
blocks on the simulated network (:meth:`Answer.wait`), and the event that answers it waits
again until the job has gone on to its end. One thread runs at a time, in an order the events
decide, so a run stays deterministic while the leader's own code runs unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class Turns:
    """The turn: the clock's thread's, or one job's."""

    def __init__(self) -> None:
        self._back = threading.Semaphore(0)  # released by a job that blocks or ends: the clock's turn again
        self.threads: list[threading.Thread] = []

    def run(self, job: Callable[[], None], name: str) -> None:
        """(The clock's thread) run ``job`` on a thread of its own until it blocks or ends."""
        def turn() -> None:
            try:
                job()
            finally:
                self.hand_back()

        thread = threading.Thread(target=turn, name=name, daemon=True)
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()
        self.wait_turn()

    def wait_turn(self) -> None:
        """(The clock's thread) until the job that has the turn blocks or ends."""
        self._back.acquire()

    def hand_back(self) -> None:
        """(A job's thread) give the turn back to the clock's thread: the job blocks or ends."""
        self._back.release()

    def join(self) -> None:
        """Wait for the jobs' threads to end (every job answered or abandoned)."""
        for thread in self.threads:
            thread.join()
        self.threads = []


class Answer:
    """The answer to one call a job blocks on: given by an event on the clock's thread."""

    def __init__(self, turns: Turns) -> None:
        self._turns = turns
        self._given = threading.Semaphore(0)
        self._value: Any = None
        self._error: BaseException | None = None

    def wait(self) -> Any:
        """(The job) hand the turn back and block until the answer is given; return or raise it."""
        self._turns.hand_back()
        self._given.acquire()
        if self._error is not None:
            raise self._error
        return self._value

    def give(self, value: Any = None, error: BaseException | None = None) -> None:
        """(The clock's thread) resume the job with ``value`` (or ``error`` raised), and wait until
        it blocks again or ends."""
        self._value, self._error = value, error
        self._given.release()
        self._turns.wait_turn()


class TurnExecutor(Executor):
    """An executor whose jobs take turns with the clock (:class:`Turns`)."""

    def __init__(self, turns: Turns, name: str) -> None:
        self.turns, self.name = turns, name

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()

        def job() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - the future carries it, as a pool's does
                future.set_exception(err)
            else:
                future.set_result(result)

        future.set_running_or_notify_cancel()
        self.turns.run(job, self.name)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing queued to cancel (a job starts at once); a job blocked on the network goes on
        when its answer comes, or ends when the simulation abandons it (its island died)."""
