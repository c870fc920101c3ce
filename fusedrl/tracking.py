"""Step metrics to the configured backends (``trainer.logger``).

Backends (``KNOWN_LOGGERS``):

* ``console``: one line per step, ``[step/total pct%] step N | reward ... | time: ... | eta ...``.
* ``jsonl``: one JSON object per step appended to ``{run_dir}/metrics.jsonl``.
* ``file``: verl's file logger: one ``{"step": N, "data": {metric: value}}`` line per step, written to
  ``$VERL_FILE_LOGGER_PATH``, else ``$VERL_FILE_LOGGER_ROOT`` (default ``.``)``/{project}/{experiment}.jsonl``
  (the file is started afresh, as verl does).
* ``tensorboard``: scalars per metric per step, written under ``$TENSORBOARD_DIR`` or ``{run_dir}/tensorboard``.
* ``wandb``: a Weights & Biases run under ``{run_dir}/wandb``; offline unless ``WANDB_MODE`` says otherwise,
  so nothing needs the network until the run is synced (``wandb sync``).

``tensorboard`` and ``wandb`` are optional packages, imported only when their backend is asked for.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

KNOWN_LOGGERS = ("console", "jsonl", "file", "tensorboard", "wandb")

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


def format_duration(seconds: float) -> str:
    """Compact duration: ``42s``, ``3m07s``, ``2h05m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_console(
    step: int,
    metrics: Mapping[str, float],
    *,
    total_steps: int | None = None,
    eta_s: float | None = None,
) -> str:
    """The console line for one step; ``total_steps`` adds a ``[step/total pct%]`` prefix, ``eta_s`` a tail."""
    parts = [f"step {step}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    times = [f"{k} {metrics[f'timing_s/{k}']:.2f}s" for k in TIMING_FIELDS if f"timing_s/{k}" in metrics]
    if times:
        parts.append("time: " + " ".join(times))
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    line = " | ".join(parts)
    if total_steps:
        line = f"[{step}/{total_steps} {100.0 * step / total_steps:.0f}%] {line}"
    return line


class _StepClock:
    """Mean wall time per step since the first logged step, and the time left from it."""

    def __init__(self) -> None:
        self.clock = time.monotonic
        self._anchor: tuple[int, float] | None = None

    def mean_step_s(self, step: int, metrics: Mapping[str, float]) -> float | None:
        now = self.clock()
        if self._anchor is None or step < self._anchor[0]:
            self._anchor = (step, now)
        first_step, first_time = self._anchor
        if step > first_step:
            return (now - first_time) / (step - first_step)
        # Only one step seen so far: the trainer's own timing of it is the best estimate there is.
        return metrics.get("timing_s/step")

    def eta_s(self, step: int, total_steps: int | None, metrics: Mapping[str, float]) -> float | None:
        mean = self.mean_step_s(step, metrics)
        if not total_steps or mean is None or step >= total_steps:
            return None
        return mean * (total_steps - step)


def verl_file_logger_path(project_name: str, experiment_name: str | None) -> str:
    """Where the ``file`` backend writes, as verl's file logger: ``$VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT`` (default ``.``) ``/{project_name}/{experiment_name}.jsonl``."""
    path = os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return path
    root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
    return os.path.join(root, project_name, f"{experiment_name or 'run'}.jsonl")


class Tracker:
    """Fans one metrics dict per step out to the configured backends.

    ``project_name``, ``experiment_name`` and ``config`` (a plain dict) describe the run to wandb (and the
    config is recorded as text in TensorBoard); ``total_steps`` turns on the console progress prefix and ETA.
    """

    def __init__(
        self,
        backends: list[str],
        *,
        run_dir: str,
        stream: TextIO | None = None,
        project_name: str = "fusedrl",
        experiment_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.backends = list(dict.fromkeys(backends))
        unknown = [b for b in self.backends if b not in KNOWN_LOGGERS]
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; known: {', '.join(KNOWN_LOGGERS)}")
        self.stream = stream or sys.stdout
        self.run_dir = run_dir
        self.total_steps = int(total_steps) if total_steps else None
        self.step_clock = _StepClock()
        self._jsonl: TextIO | None = None
        self._file: TextIO | None = None
        self._tb: Any = None
        self._wandb_run: Any = None
        self.tensorboard_dir: str | None = None
        try:
            if "jsonl" in self.backends:
                os.makedirs(run_dir, exist_ok=True)
                self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
                self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the run)
            if "file" in self.backends:
                self.file_path = verl_file_logger_path(project_name, experiment_name)
                os.makedirs(os.path.dirname(os.path.abspath(self.file_path)), exist_ok=True)
                self._file = open(self.file_path, "w", encoding="utf-8")  # noqa: SIM115 (lives as long as the run)
            if "tensorboard" in self.backends:
                self._open_tensorboard(config)
            if "wandb" in self.backends:
                self._open_wandb(project_name, experiment_name, config)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ backends
    def _open_tensorboard(self, config: Mapping[str, Any] | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "trainer.logger includes 'tensorboard' but it cannot be imported here: pip install tensorboard"
            ) from e
        self.tensorboard_dir = os.environ.get("TENSORBOARD_DIR") or os.path.join(self.run_dir, "tensorboard")
        os.makedirs(self.tensorboard_dir, exist_ok=True)
        self._tb = SummaryWriter(log_dir=self.tensorboard_dir)
        if config:
            text = json.dumps(dict(config), indent=2, sort_keys=True, default=str)
            # Four-space indent: TensorBoard's text plugin renders it as a code block.
            self._tb.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)
            self._tb.flush()

    def _open_wandb(
        self, project_name: str, experiment_name: str | None, config: Mapping[str, Any] | None
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "trainer.logger includes 'wandb' but the wandb package is not installed: pip install wandb"
            ) from e
        os.makedirs(self.run_dir, exist_ok=True)
        mode: Any = os.environ.get("WANDB_MODE", "offline")  # wandb itself rejects a bad value
        self._wandb_run = wandb.init(
            project=project_name,
            name=experiment_name,
            config=dict(config) if config is not None else None,
            dir=self.run_dir,
            mode=mode,
            # This tracker owns its run: never hand back (or finish) a run another tracker opened.
            reinit="create_new",
        )

    @property
    def wandb_run(self) -> Any:
        """The wandb ``Run`` (``None`` without the wandb backend or after ``close``)."""
        return self._wandb_run

    # ------------------------------------------------------------------ logging
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items()}  # fail before any backend has written
        step = int(step)
        eta = self.step_clock.eta_s(step, self.total_steps, values)
        if "console" in self.backends:
            line = format_console(step, values, total_steps=self.total_steps, eta_s=eta)
            print(line, file=self.stream, flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        if self._file is not None:
            self._file.write(json.dumps({"step": step, "data": values}) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)

    def close(self) -> None:
        """Flush and close every backend; safe to call more than once."""
        jsonl, self._jsonl = self._jsonl, None
        file, self._file = self._file, None
        tb, self._tb = self._tb, None
        run, self._wandb_run = self._wandb_run, None
        try:
            if jsonl is not None:
                jsonl.close()
            if file is not None:
                file.close()
        finally:
            try:
                if tb is not None:
                    tb.close()
            finally:
                if run is not None:
                    run.finish()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
