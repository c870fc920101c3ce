"""Step metrics to the console and to a JSON-lines file (``trainer.logger``)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

# (metric, short label, format) shown on the console line, in this order, when present.
CONSOLE_FIELDS = (
    ("critic/score/mean", "reward", "{:.3f}"),
    ("val/test_score/mean", "val", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("actor/kl_loss", "kl", "{:.5f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("actor/grad_norm", "grad_norm", "{:.3f}"),
    ("perf/throughput", "tok/s", "{:.0f}"),
)
TIMING_FIELDS = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync_weights", "step")


@contextmanager
def timer(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``metrics["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def format_console(step: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    times = [f"{k} {metrics[f'timing_s/{k}']:.2f}s" for k in TIMING_FIELDS if f"timing_s/{k}" in metrics]
    if times:
        parts.append("time: " + " ".join(times))
    return " | ".join(parts)


class Tracker:
    """Fans one metrics dict per step out to the configured backends."""

    def __init__(self, backends: list[str], *, run_dir: str, stream: TextIO | None = None) -> None:
        self.backends = list(backends)
        self.stream = stream or sys.stdout
        self._jsonl: TextIO | None = None
        if "jsonl" in self.backends:
            os.makedirs(run_dir, exist_ok=True)
            self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the run)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if "console" in self.backends:
            print(format_console(step, metrics), file=self.stream, flush=True)
        if self._jsonl is not None:
            record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
