"""A lookup tool over a table the prompt never shows, for the CPU agentic example (examples/agentic/
run_tiny_cpu.sh; listed in lookup_tools.yaml as ``lookup.py:lookup``)."""

from __future__ import annotations

import random


def room_code(room: int) -> int:
    """The hidden table: a fixed pseudo-random 3-digit code per room 100-999 (no pattern to learn)."""
    return random.Random(f"room-{room}").randint(100, 999)


def lookup(room: int) -> str:
    """Look up the door code of a room.

    Args:
        room: the room number, 100-999.
    """
    if isinstance(room, bool) or not isinstance(room, int) or not 100 <= room <= 999:
        raise ValueError(f"room must be an integer from 100 to 999, got {room!r}")
    return str(room_code(room))
