"""When each fragment is due.

Convention: ``t`` is the number of inner steps completed (1, 2, ...). Fragment p is due when
``t % H == offset_p``. Offsets are spread evenly over [0, H): fragment p is first due after
``(p + 1) * H // P`` steps, so the last fragment (and, with P = 1, the only one) is due after
steps H, 2H, ... At P = H exactly one fragment is due on every step.
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
