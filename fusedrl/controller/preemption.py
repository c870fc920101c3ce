"""SIGTERM / SIGINT on the driver: finish the step in flight, checkpoint it, stop the workers, exit 75.

A cluster scheduler that preempts a job sends SIGTERM and, some time later, SIGKILL. `PreemptionGuard`
turns the first SIGTERM (or Ctrl-C) into a request the training loop honours between steps: the step in
flight is finished, a checkpoint of it is written even when ``trainer.save_freq`` would not save it, the
workers are shut down and the process exits with `PREEMPTED_EXIT_CODE`. All of that must happen within
``trainer.preemption_save_timeout_s`` of the signal; when the deadline passes during a remote call the step
is abandoned (the workers are stopped, the newest checkpoint on disk stays the resume point). A second
signal exits at once (code 128 + signal number) after killing the local worker processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

# EX_TEMPFAIL from sysexits.h: "a temporary failure; the user is invited to retry" (rerun resumes).
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """The run stopped on a signal; rerunning the same command resumes it. ``exit_code`` is 75."""

    exit_code = PREEMPTED_EXIT_CODE


class PreemptionGuard:
    """Installs SIGTERM/SIGINT handlers while active (``with guard:``); see the module docstring.

    ``timeout_s`` (``trainer.preemption_save_timeout_s``) bounds the time from the first signal to exit.
    ``on_exit_now`` is called on the second signal before ``os._exit`` (it kills the worker processes).
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = float(timeout_s) if timeout_s else None
        self.signum: int | None = None
        self.received_at: float | None = None
        self.on_exit_now: Callable[[], None] | None = None
        self._previous: dict[int, Any] = {}

    # ------------------------------------------------------------------ installation
    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"fusedrl: second signal ({name}): exiting now without a checkpoint\n".encode())
            if self.on_exit_now is not None:
                with contextlib.suppress(Exception):  # exiting anyway
                    self.on_exit_now()
            os._exit(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        budget = f"within {self.timeout_s:g} s" if self.timeout_s else "(no time limit)"
        # os.write: print() is not safe inside a handler that may interrupt another print.
        os.write(
            2,
            f"fusedrl: received {name}: finishing the current step, then saving a checkpoint and stopping "
            f"{budget} (trainer.preemption_save_timeout_s). Send it again to exit at once.\n".encode(),
        )

    # ------------------------------------------------------------------ queries
    @property
    def requested(self) -> bool:
        return self.signum is not None

    def seconds_left(self) -> float | None:
        if self.received_at is None or self.timeout_s is None:
            return None
        return self.timeout_s - (time.monotonic() - self.received_at)

    def check_deadline(self, what: str) -> None:
        """Raise `Preempted` when a signal came and its time budget ran out (``what``: the call in flight)."""
        left = self.seconds_left()
        if left is not None and left <= 0:
            raise Preempted(
                f"{self._name()} received {self.timeout_s:g} s ago (trainer.preemption_save_timeout_s) and "
                f"{what} had not finished: the step was abandoned and the workers stopped; no new checkpoint "
                "was written."
            )

    def stopped(self, step: int, checkpoint: str | None, hint: str) -> Preempted:
        """The exception that ends a run stopped cleanly after ``step`` (checkpointed at ``checkpoint``)."""
        saved = f"saved {checkpoint}" if checkpoint else "no checkpoint was written"
        return Preempted(f"{self._name()}: stopped after step {step}; {saved}.\n{hint}")

    def _name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"
