"""The rollout engine's phase, owned by the worker that holds it (issue 39, item 3).

Two facts the step's memory moves depend on, kept in one place with every move recorded:

* whether the engine is **asleep** (it released its memory: KV cache, and at level 2 its weights), and
* whether its **weights** are the actor's: ``current``, ``stale`` (the actor trained, or its state was
  restored, since the last stream) or ``discarded`` (a level-2 sleep threw them away).

Moves are safe to repeat (a second ``sleep`` of a sleeping engine is a no-op and is not recorded again); a
move the engine cannot make raises (a partial, LoRA-modules-only stream into discarded weights: only a full
stream restores them). `needs_stream` is what the next rollout asks: stream first unless ``current``.

Policy versions make the decision on the workers (the driver keeps no flag): the worker holding the actor
counts its changes (``actor_version``: one per update or restored checkpoint), the engine records the version
it last received (``engine_version``). Where both share a worker the phase sees the actor change itself;
a rollout on a pool of its own is told the actor's version at the sync (`wants`) and finds itself stale when
it holds another. ``streams`` / ``skipped`` count the syncs that streamed and those the phase skipped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

WEIGHTS = ("current", "stale", "discarded")
MAX_MOVES = 64


class IllegalMove(RuntimeError):
    """A move the engine's phase does not allow (the message names the phase and the way out)."""


@dataclass
class EnginePhase:
    """The engine's sleep state and the state of its weights (module docstring); ``moves``: the last
    `MAX_MOVES` moves that changed something, oldest first."""

    asleep: bool = False
    weights: str = "current"
    moves: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_MOVES))
    actor_version: int = 0  # changes of this worker's actor (updates, restores)
    engine_version: int = 0  # the actor version the engine's weights were streamed from
    streams: int = 0
    skipped: int = 0

    @property
    def needs_stream(self) -> bool:
        """Whether the engine's weights differ from the actor's, so a stream must come before sampling."""
        return self.weights != "current"

    def _move(self, name: str, *, asleep: bool | None = None, weights: str | None = None) -> bool:
        new_asleep = self.asleep if asleep is None else asleep
        new_weights = self.weights if weights is None else weights
        if (new_asleep, new_weights) == (self.asleep, self.weights):
            return False  # repeated: nothing changes, nothing is recorded
        self.asleep, self.weights = new_asleep, new_weights
        self.moves.append(f"{name} -> {'asleep' if new_asleep else 'awake'}, weights {new_weights}")
        return True

    def sleep(self, *, discards_weights: bool) -> bool:
        """The engine released its memory; with ``discards_weights`` (level 2) its weights too. Returns
        whether anything changed."""
        return self._move("sleep", asleep=True, weights="discarded" if discards_weights else None)

    def wake(self) -> bool:
        """The engine mapped its memory back (discarded weights stay discarded until a full stream)."""
        return self._move("wake", asleep=False)

    def actor_changed(self) -> bool:
        """The actor's weights moved (an update, a restored checkpoint): current weights become stale."""
        self.actor_version += 1
        return self._move("actor_changed", weights="stale" if self.weights == "current" else None)

    def wants(self, version: int | None = None) -> bool:
        """A sync asks whether the engine needs the actor's weights of ``version`` (None: this worker's own
        actor, whose changes the phase saw). Weights from another version become stale; an answer of no is
        counted in ``skipped``."""
        if version is not None and version != self.engine_version:
            self._move("actor_changed", weights="stale" if self.weights == "current" else None)
        if not self.needs_stream:
            self.skipped += 1
        return self.needs_stream

    def streamed(self, *, full: bool, version: int | None = None) -> bool:
        """The actor's weights (of ``version``; None: this worker's actor's) reached the engine: all of them
        (``full``) or only the adapted modules."""
        if not full and self.weights == "discarded":
            raise IllegalMove(
                "a partial stream into weights a level-2 sleep discarded: only a full stream restores them"
            )
        self.engine_version = self.actor_version if version is None else version
        self.streams += 1
        return self._move("stream" if full else "stream(partial)", weights="current")

    def report(self) -> dict[str, Any]:
        """What `WorkerDict.rollout_phase` answers: the phase, the versions, the counts and the moves."""
        return {
            "asleep": self.asleep,
            "weights": self.weights,
            "needs_stream": self.needs_stream,
            "actor_version": self.actor_version,
            "engine_version": self.engine_version,
            "streams": self.streams,
            "skipped": self.skipped,
            "moves": list(self.moves),
        }
