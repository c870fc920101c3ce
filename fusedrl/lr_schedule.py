"""Learning-rate schedules of the RL roles (verl's ``optim.lr_warmup_steps`` / ``lr_scheduler_type`` keys).

The schedule advances once per RL step, as verl's does, and is a pure function of the step: the driver
computes each step's rate and passes it to the update call, so a resumed run (which restores
``global_step``) continues the schedule exactly where it stopped; there is no scheduler state to save.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SCHEDULERS = ("constant", "cosine")  # optim.warmup_style / lr_scheduler_type (SFT: optim.lr_scheduler)


def warmup_steps(optim: Mapping[str, Any], total_steps: int) -> int:
    """``lr_warmup_steps`` when >= 0, else ``int(lr_warmup_steps_ratio * total_steps)``."""
    steps = int(optim["lr_warmup_steps"])
    return steps if steps >= 0 else int(float(optim["lr_warmup_steps_ratio"]) * total_steps)


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup: int,
    style: str,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """Multiplier of the base rate at RL step ``step`` (0-based).

    Warmup: linear from 0, ``step / warmup`` for ``step < warmup`` (the first step has rate 0, as in
    verl). Then ``constant`` (1.0) or ``cosine``: ``m + (1 - m) * (1 + cos(2 pi c p)) / 2`` with
    ``p = (step - warmup) / (total_steps - warmup)``, ``m = min_lr_ratio``, ``c = num_cycles``, floored at
    ``m`` (half a period, from 1 down to ``m``, for the default c = 0.5).
    """
    if style not in SCHEDULERS:
        raise ValueError(f"unknown lr schedule {style!r}; use {' or '.join(SCHEDULERS)}")
    if step < warmup:
        return step / max(1, warmup)
    if style == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    wave = math.cos(math.pi * num_cycles * 2.0 * progress)
    return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + wave))


def scheduled_lr(optim: Any, step: int, total_steps: int) -> float:
    """The rate of one optimizer (``actor_rollout_ref.actor.optim`` or ``critic.optim``: the typed
    `fusedrl.role_config.OptimConfig`, or a mapping of its keys) at RL step ``step``."""
    if dataclasses.is_dataclass(optim) and not isinstance(optim, type):
        optim = dataclasses.asdict(optim)
    style = optim["warmup_style"] if optim["warmup_style"] is not None else optim["lr_scheduler_type"]
    factor = lr_factor(
        step,
        total_steps=total_steps,
        warmup=warmup_steps(optim, total_steps),
        style=str(style),
        min_lr_ratio=float(optim["min_lr_ratio"]),
        num_cycles=float(optim["num_cycles"]),
    )
    return float(optim["lr"]) * factor
