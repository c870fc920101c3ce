"""Memory moves that travel with the next call instead of as calls of their own.

Between a step's phases the driver sends memory moves (load / offload a role, wake / sleep the engine), which
answer nothing. Where the run's roles share one worker group those need no round trip
(`fusedrl.controller.worker_group.WorkerGroup.send_all`); sent as separate Ray calls they still cost a
submission on the driver and a task on the worker each, and a worker that finished a phase waits for them
to arrive before the next call can start (a GRPO step of a small model sent 11 of them). Instead the driver
keeps them, per rank, as `Move` s and hands them to that rank's next call: `MoveCarrier.after_moves` runs
them in the order sent, then the call (its top-level object references resolved, as Ray does for a direct
call). The order of what a worker runs is the same as with separate calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass(frozen=True)
class Move:
    """One memory move: a worker method, its arguments."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class MoveFailed(RuntimeError):
    """A carried move raised; the call it travelled with did not run."""


class MoveCarrier:
    """The worker's side: a mixin of the fused worker classes."""

    def after_moves(
        self, moves: list[Move], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``moves`` in order, then ``method(*args, **kwargs)``; its answer."""
        for move in moves:
            try:
                getattr(self, move.method)(*move.args, **move.kwargs)
            except Exception as err:
                raise MoveFailed(
                    f"the memory move `{move.method}` (sent before `{method}`) failed: {type(err).__name__}: {err}"
                ) from err
        # The call's arguments arrive inside a tuple, where Ray resolves no object reference: do it here, as Ray
        # does for a direct call's top-level arguments.
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        kwargs = {k: ray.get(v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
        return getattr(self, method)(*args, **kwargs)
