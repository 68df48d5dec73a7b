"""When each fragment is due, and which round of the run a send belongs to.

Convention: ``t`` is the number of inner steps completed (1, 2, ...). Fragment p is due when
``t % H == offset_p``. Offsets are spread evenly over [0, H): fragment p is first due after
``(p + 1) * H // P`` steps, so the last fragment (and, with P = 1, the only one) is due after
steps H, 2H, ... At P = H exactly one fragment is due on every step.

The step an island counts here is its *schedule step*: the run's clock, set from the
synchronizer when the island joins and moved forward when the synchronizer asks for a round
the island has not reached yet. Round r of fragment p is the send due at schedule step
``r * H + offset_p``; the synchronizer closes each round once, so every island that sends
fragment p at the same schedule step contributes to the same outer step.
"""

from __future__ import annotations


def fragment_offsets(num_fragments: int, sync_every: int) -> tuple[int, ...]:
    if not 1 <= num_fragments <= sync_every:
        raise ValueError(f"need 1 <= num_fragments ({num_fragments}) <= sync_every ({sync_every})")
    return tuple(((p + 1) * sync_every // num_fragments) % sync_every for p in range(num_fragments))


def due_fragment(step: int, offsets: tuple[int, ...], sync_every: int) -> int | None:
    """The fragment due after ``step`` completed inner steps, or None. Offsets are distinct."""
    if step <= 0:
        return None
    phase = step % sync_every
    for p, offset in enumerate(offsets):
        if offset == phase:
            return p
    return None


def round_of(step: int, sync_every: int) -> int:
    """The round a send due at schedule step ``step`` belongs to."""
    return step // sync_every


def latest_round(step: int, offset: int, sync_every: int) -> int:
    """The latest round of the fragment with ``offset`` due by schedule step ``step``; -1: none yet."""
    return (step - offset) // sync_every if step >= offset and step > 0 else -1


def due_step(round_index: int, offset: int, sync_every: int) -> int:
    """The schedule step at which round ``round_index`` of the fragment with ``offset`` is due."""
    return round_index * sync_every + offset
