"""A lookup tool over a table the prompt never shows, for the CPU agentic example (examples/agentic/
run_tiny_cpu.sh; listed in lookup_tools.yaml as ``lookup.py:lookup``)."""

from __future__ import annotations

import random
import string


def is_room(room: object) -> bool:
    """Rooms are named by three capital letters, ``AAA``-``ZZZ`` (no digits: a code is the only number a
    conversation holds)."""
    return isinstance(room, str) and len(room) == 3 and all(ch in string.ascii_uppercase for ch in room)


def room_code(room: str) -> int:
    """The hidden table: a fixed pseudo-random 3-digit code per room (no pattern to learn)."""
    return random.Random(f"room-{room}").randint(100, 999)


def lookup(room: str) -> str:
    """Look up the door code of a room.

    Args:
        room: the room's name, three capital letters.
    """
    if not is_room(room):
        raise ValueError(f"room must be three capital letters, got {room!r}")
    return str(room_code(room))
