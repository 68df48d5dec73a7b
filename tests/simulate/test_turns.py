"""Push threads that take turns with the virtual clock (lightning_diloco/simulate/turns.py)."""

from __future__ import annotations

import pytest

from lightning_diloco.simulate.turns import Answer, TurnExecutor, Turns


def test_a_job_runs_only_while_the_clock_waits_for_it_and_its_answer_resumes_it_to_the_end():
    turns, seen = Turns(), []
    answer = Answer(turns)

    def push(x):
        seen.append(f"encoded {x}")
        ack = answer.wait()  # blocked on the network: the clock's thread goes on
        seen.append(f"acked {ack}")
        return ack

    future = TurnExecutor(turns, "push").submit(push, 1)
    assert seen == ["encoded 1"] and not future.done()  # submit returned once the job blocked
    seen.append("other events")
    answer.give("round 3")  # returns once the job has gone on to its end
    assert seen == ["encoded 1", "other events", "acked round 3"] and future.result(timeout=0) == "round 3"
    turns.join()


def test_a_refused_call_and_a_failing_job_end_in_their_futures():
    turns = Turns()
    executor = TurnExecutor(turns, "push")
    answer = Answer(turns)
    refused = executor.submit(answer.wait)
    answer.give(error=ConnectionError("island 1's process died"))
    with pytest.raises(ConnectionError, match="process died"):
        refused.result(timeout=0)
    with pytest.raises(ZeroDivisionError):
        executor.submit(lambda: 1 / 0).result(timeout=0)
    turns.join()
