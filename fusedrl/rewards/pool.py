"""Run a scoring function over many samples in worker processes, with a time limit per sample.

Each worker is a `multiprocessing` process that receives one sample at a time over its own pipe, so the
driver knows which sample every worker is on and since when. A worker that passes the sample's deadline
is killed (SIGKILL, with its whole process group, so subprocesses the scorer started go too) and replaced
by a fresh one; its sample is reported as timed out. A worker that dies on its own (segfault,
``os._exit``) is replaced the same way and its sample reported as failed. Workers live as long as the
pool, so their start-up cost (interpreter, imports) is paid once, not per batch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ON_ERROR_CHOICES = ("raise", "zero")  # reward_model.on_error: what a failed scoring call does
START_METHODS = ("fork", "spawn", "forkserver")
START_TIMEOUT_S = 120.0  # a fresh worker must import and warm up within this; it is not a sample's time
_READY = "ready"


class RemoteError(Exception):
    """An exception raised by the scoring function inside a worker, carried back as text."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(type_name, message, traceback_text)
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class ScoringTimeout(TimeoutError):
    """The scoring function ran past the per-sample time limit; its worker was killed."""


class WorkerDied(RuntimeError):
    """The worker process exited while scoring a sample."""


@dataclass
class Outcome:
    """What scoring one sample gave: ``value`` on success, else ``error`` (``timed_out`` for a timeout)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def call_inline(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Outcome:
    """Score one sample in this process (no time limit)."""
    try:
        return Outcome(value=fn(**kwargs))
    except Exception as exc:
        return Outcome(error=exc)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its parent dies, so that a worker stuck in a hung
    scorer does not outlive a crashed driver. Best effort; elsewhere a worker exits when its pipe closes."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def _worker_loop(conn: multiprocessing.connection.Connection, fn: Callable[..., Any]) -> None:
    # Ctrl-C goes to the driver, which kills its workers; a worker only stops on request, EOF or a kill.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.setpgrp()  # own process group: a kill on timeout also reaches the scorer's subprocesses
    _die_with_parent()
    warm_up = getattr(fn, "warm_up", None)
    if callable(warm_up):
        with contextlib.suppress(Exception):  # a real problem shows again, per sample, when scoring
            warm_up()
    try:
        conn.send(_READY)  # start-up (imports, warm-up) does not count against any sample's time limit
    except OSError:
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the driver went away
        if message is None:
            return
        index, kwargs = message
        try:
            reply = (index, True, fn(**kwargs))
        except BaseException as exc:  # SystemExit from a scorer is a failed sample, not a dead worker
            reply = (index, False, RemoteError(type(exc).__name__, str(exc), traceback.format_exc()))
        try:
            try:
                conn.send(reply)  # pickles first, so a failure here has written nothing yet
            except (BrokenPipeError, EOFError):
                raise
            except Exception as exc:  # e.g. a result that cannot be pickled
                conn.send(
                    (index, False, RemoteError(type(exc).__name__, f"cannot send the result back: {exc}"))
                )
        except OSError:
            return


class _Worker:
    def __init__(self, ctx: Any, fn: Callable[..., Any]) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_loop, args=(child_conn, fn), daemon=True, name="fusedrl-reward-worker"
        )
        try:
            self.process.start()
        except Exception as exc:
            parent_conn.close()
            child_conn.close()
            raise TypeError(
                f"cannot start a reward worker with the {ctx.get_start_method()!r} start method for "
                f"{fn!r}: {type(exc).__name__}: {exc}. With spawn/forkserver the reward function must be "
                f"picklable (a module-level function, or one loaded from custom_reward_function.path); "
                f"reward_model.mp_context=fork accepts any function"
            ) from exc
        child_conn.close()  # only the child holds its end now: its death shows up here as EOF
        self.conn = parent_conn
        self.ready = False
        self.task: int | None = None
        self.deadline = time.monotonic() + START_TIMEOUT_S  # until ready: the start-up deadline

    def kill(self) -> None:
        pid = self.process.pid
        if pid is not None and self.process.exitcode is None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # its group id is its pid once it ran os.setpgrp()
            with contextlib.suppress(OSError, ValueError):
                self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:  # ask all first, then wait: they wind down in parallel
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send(None)
    deadline = time.monotonic() + 1.0
    while workers:
        worker = workers.pop()
        worker.process.join(timeout=max(deadline - time.monotonic(), 0.0))
        worker.kill()


class ScoringPool:
    """``num_workers`` processes that call ``fn(**kwargs)`` for each sample, ``timeout_s`` seconds each.

    ``mp_context`` picks how workers start: ``fork`` (fast, any function, but forks the driver with its
    threads), ``spawn`` or ``forkserver`` (clean processes; ``fn`` must be picklable). Use as a context
    manager or call `close`; leftover workers are stopped at garbage collection and interpreter exit too.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int,
        timeout_s: float | None = 10.0,
        mp_context: str = "forkserver",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(
                f"ScoringPool timeout_s must be > 0 seconds (or None for no limit), got {timeout_s}"
            )
        if mp_context not in START_METHODS:
            raise ValueError(f"ScoringPool mp_context must be one of {START_METHODS}, got {mp_context!r}")
        self.fn = fn
        self.num_workers = int(num_workers)
        self.timeout_s = timeout_s
        self._ctx = multiprocessing.get_context(mp_context)
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def map(self, calls: Sequence[dict[str, Any]]) -> list[Outcome]:
        """One `Outcome` per entry of ``calls`` (keyword arguments for ``fn``), in order."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        try:
            while pending or any(w.task is not None for w in self._workers):
                self._dispatch(pending, calls, outcomes)
                self._collect(outcomes)
        except BaseException:
            self.close()  # workers may still hold samples of this call: start clean next time
            raise
        return [o if o is not None else Outcome(error=WorkerDied("no result")) for o in outcomes]

    def _dispatch(self, pending: deque[int], calls: Sequence[dict[str, Any]], outcomes: list) -> None:
        for worker in [w for w in self._workers if w.task is None and w.ready and not w.process.is_alive()]:
            self._discard(worker)  # died while idle (e.g. killed from outside): replace it, blame no sample
        free = [w for w in self._workers if w.task is None]  # ready or still starting
        while len(free) < len(pending) and len(self._workers) < self.num_workers:
            worker = _Worker(self._ctx, self.fn)
            self._workers.append(worker)
            free.append(worker)
        for worker in free:
            if not worker.ready:
                continue
            if not pending:
                break
            index = pending.popleft()
            try:
                worker.conn.send((index, calls[index]))
            except (OSError, ValueError) as exc:  # the worker is gone; a fresh one takes the next sample
                outcomes[index] = Outcome(error=WorkerDied(f"reward worker unreachable: {exc}"))
                self._discard(worker)
                continue
            worker.task = index
            worker.deadline = (
                time.monotonic() + self.timeout_s if self.timeout_s is not None else float("inf")
            )

    def _collect(self, outcomes: list) -> None:
        busy = [w for w in self._workers if w.task is not None or not w.ready]
        if not busy:
            return
        wait_s = min(w.deadline for w in busy) - time.monotonic()
        ready = multiprocessing.connection.wait(
            [w.conn for w in busy], timeout=None if wait_s == float("inf") else max(wait_s, 0.0)
        )
        for worker in busy:
            if worker.conn not in ready:
                continue
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=1)
                died = f"reward worker process exited (exit code {worker.process.exitcode})"
                if worker.task is None:  # died while starting: nothing of ours to blame it on
                    self._discard(worker)
                    raise WorkerDied(f"{died} before it was ready; reward function: {self.fn!r}") from None
                outcomes[worker.task] = Outcome(error=WorkerDied(died))
                self._discard(worker)
                continue
            if message == _READY:
                worker.ready = True
                continue
            index, ok, value = message
            outcomes[index] = Outcome(value=value) if ok else Outcome(error=value)
            worker.task = None
        now = time.monotonic()
        for worker in busy:
            if not worker.ready and worker in self._workers and now >= worker.deadline:
                self._discard(worker)
                raise WorkerDied(
                    f"a reward worker did not start within {START_TIMEOUT_S:g} s; reward function: {self.fn!r}"
                )
            if worker.task is not None and now >= worker.deadline:
                outcomes[worker.task] = Outcome(
                    error=ScoringTimeout(f"no result within the {self.timeout_s:g} s limit; worker killed"),
                    timed_out=True,
                )
                self._discard(worker)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        worker.task = None
        self._workers.remove(worker)

    @property
    def num_alive(self) -> int:
        """Worker processes currently running (started lazily, at most ``num_workers``)."""
        return sum(w.process.is_alive() for w in self._workers)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def close(self) -> None:
        """Stop every worker (politely, then by kill)."""
        _stop_all(self._workers)

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
