"""Per-step health checks of the driver: too many skipped (non-finite) optimizer steps in a row, or a
rollout engine whose log-probs drift from the actor's (stale or corrupt weights)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusedrl.auto_defaults import AUTO, driver_value
from fusedrl.checkpoint import find_latest_checkpoint
from fusedrl.controller.placement import cluster_has_gpus
from fusedrl.metrics import Metrics
from fusedrl.role_config import RoleConfigs
from fusedrl.workers.rollout.base import log_prob_gap_bound, rollout_dtype


def check_step(run: RoleConfigs, step: int, metrics: Metrics, tol: float | None) -> None:
    """Raise with a report when ``trainer.max_consecutive_skipped_steps`` is reached or the mean
    |rollout - actor| log-prob gap exceeds ``tol`` (NaN, from garbage weights, exceeds it too)."""
    tr = run.trainer
    limit = tr.max_consecutive_skipped_steps
    skipped = int(metrics.get("actor/consecutive_skipped_steps", 0))
    if limit > 0 and skipped >= limit:
        last_good = find_latest_checkpoint(tr.default_local_dir)
        raise RuntimeError(
            f"step {step}: the last {skipped} optimizer steps were skipped because the loss or "
            f"grad norm was not finite (trainer.max_consecutive_skipped_steps={limit}). Last good checkpoint: "
            f"{last_good or 'none'}. Lower the learning rate or check the rewards/advantages for NaN."
        )
    gap = metrics.get("rollout/log_prob_abs_diff_mean")
    if tol is not None and gap is not None and not gap <= tol:
        raise RuntimeError(
            f"step {step}: the rollout engine's log-probs differ from the actor's by {gap:.2e} on "
            f"average (trainer.rollout_check_tol={tol:g}). The engine is running stale or corrupt weights: "
            "the weight sync did not land. Set trainer.rollout_check_tol=null to disable this check."
        )


def rollout_check_bound(run: RoleConfigs, settings: Mapping[str, Any] | None = None) -> float | None:
    """``trainer.rollout_check_tol`` as a number; ``auto`` resolves by `auto_rollout_check_tol`
    (``settings``: the ``auto`` keys as the workers resolved them, `fusedrl.auto_defaults`)."""
    tol = run.trainer.rollout_check_tol
    if tol == "auto":
        return auto_rollout_check_tol(run, settings or {})
    return None if tol is None else float(tol)


def auto_rollout_check_tol(run: RoleConfigs, settings: Mapping[str, Any] | None = None) -> float | None:
    """``trainer.rollout_check_tol=auto``: the bound on mean |rollout - actor| log-prob that float error
    alone stays far below. float32 on both sides agrees to ~1e-5 (bound 1e-3); bf16 on either side
    (engine dtype, or the actor's FSDP2 compute dtype) rounds logits to 8 mantissa bits, measured ~1e-3 to
    2e-2 on the tiny/small presets (bound 0.1). A sync that did not land gives NaN or gaps of order 1. Off
    for other dtypes (fp16). An actor ``param_dtype=auto`` no worker resolved may be bf16: the bf16 bound."""
    fsdp = run.actor.fsdp_config
    engine = rollout_dtype(run.rollout.dtype, cuda=cluster_has_gpus())  # the workers' devices
    param = driver_value(fsdp.param_dtype, settings or {}, "actor_rollout_ref.actor.fsdp_config.param_dtype")
    names = {engine, str(param or fsdp.model_dtype)}
    names = {{"fp32": "float32", "bf16": "bfloat16", AUTO: "bfloat16"}.get(n) or n for n in names}
    return log_prob_gap_bound(names)
