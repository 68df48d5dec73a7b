"""One fragment's sync state: what each apply mode does to its counters, and its checkpoint form."""

from __future__ import annotations

import torch

from lightning_diloco.learner.flights import Flight
from lightning_diloco.learner.fragment_sync import FragmentSync, fragments_from_state_dict, fragments_state_dict


def _sent(f: FragmentSync, snapshot=None) -> Flight:
    flight = Flight(fragment=0, round=3, apply_at=5, snapshot=snapshot, tokens_at_send=f.tokens, steps_at_send=f.steps, sent_at=0.0, future=None)
    f.sent(flight)
    return flight


def test_rebase_keeps_the_progress_made_after_the_send_and_overwrite_starts_again():
    f = FragmentSync(torch.zeros(2))
    for _ in range(4):
        f.stepped(10.0)
    _sent(f, snapshot=torch.ones(2))
    f.stepped(10.0)  # one more step while the send is in flight
    assert f.sent_round == 3 and f.flight is not None
    staleness = f.applied(torch.full((2,), 2.0), version=3, mode="rebase", ends_flight=True)
    assert (f.tokens, f.steps, f.version, f.flight, staleness) == (10.0, 1, 3, None, 2)  # versions 1 and 2 skipped
    _sent(f)
    f.applied(torch.full((2,), 3.0), version=4, mode="overwrite", ends_flight=True)
    assert (f.tokens, f.steps) == (0.0, 0) and torch.equal(f.base, torch.full((2,), 3.0))


def test_a_version_that_does_not_end_the_flight_moves_its_snapshot_with_the_fragment():
    """Rebase: another round's version arrives while a send is in flight; the send's snapshot is
    moved by the same global change, so the progress it measures stays the island's own."""
    f = FragmentSync(torch.zeros(2))
    flight = _sent(f, snapshot=torch.ones(2))
    f.applied(torch.full((2,), 0.5), version=1, mode="rebase", ends_flight=False)
    assert f.flight is flight and torch.equal(flight.snapshot, torch.full((2,), 1.5))


def test_the_checkpoint_form_round_trips_without_flights():
    fragments = [FragmentSync(torch.arange(3.0), version=2, sent_round=5, tokens=7.0, steps=3), FragmentSync(torch.ones(1))]
    _sent(fragments[1])
    back = fragments_from_state_dict(fragments_state_dict(fragments))
    assert [(f.version, f.sent_round, f.tokens, f.steps, f.flight) for f in back] == [(2, 5, 7.0, 3, None), (0, 3, 0.0, 0, None)]
    assert torch.equal(back[0].base, fragments[0].base) and back[0].base is not fragments[0].base
