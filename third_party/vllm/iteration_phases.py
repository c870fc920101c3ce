"""Where an in-process vLLM engine's iteration goes: this thread's CPU time per phase of ``LLMEngine.step``.

A profiling aid (``benchmarks/engine_iteration.py``), not used by training. With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` one ``LLMEngine.step`` runs, in this thread: the scheduler's
``schedule``, the executor's ``execute_model`` (input preparation, attention metadata, the forward, logits)
and ``sample_tokens`` (sampling, log-probs, the token bookkeeping), the scheduler's ``update_from_output`` and
the output processor's ``process_outputs``. `phase_timers` wraps these five methods on one engine's objects
(instance attributes: other engines are untouched) and adds up ``time.thread_time`` per phase; the thread's
CPU time is far less sensitive than the wall time to other processes on a shared machine. ``"step"`` is the
whole ``LLMEngine.step``; what it holds beyond the five phases is the engine core's own glue.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from fusedrl.third_party.vllm.inproc import engine_core

PHASES = ("schedule", "execute_model", "sample_tokens", "update_from_output", "process_outputs", "step")


def _targets(llm: Any) -> dict[str, tuple[Any, str]]:
    engine, core = llm.llm_engine, engine_core(llm)
    return {
        "schedule": (core.scheduler, "schedule"),
        "execute_model": (core.model_executor, "execute_model"),
        "sample_tokens": (core.model_executor, "sample_tokens"),
        "update_from_output": (core.scheduler, "update_from_output"),
        "process_outputs": (engine.output_processor, "process_outputs"),
        "step": (engine, "step"),
    }


def _timed(fn: Callable[..., Any], totals: dict[str, float], counts: dict[str, int], name: str) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.thread_time() - start
            counts[name] += 1

    return wrapper


@contextlib.contextmanager
def phase_timers(llm: Any) -> Iterator[tuple[dict[str, float], dict[str, int]]]:
    """Inside the block, ``(seconds, calls)`` per phase of ``llm`` (a vLLM ``LLM``) accumulate; the engine's
    methods are restored when it ends."""
    totals = dict.fromkeys(PHASES, 0.0)
    counts = dict.fromkeys(PHASES, 0)
    targets = _targets(llm)
    for name, (obj, attr) in targets.items():
        setattr(obj, attr, _timed(getattr(obj, attr), totals, counts, name))
    try:
        yield totals, counts
    finally:
        for obj, attr in targets.values():
            with contextlib.suppress(AttributeError):
                delattr(obj, attr)  # the instance attribute goes; the class's method shows again
