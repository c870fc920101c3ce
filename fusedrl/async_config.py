"""``async_training``, read and checked before Ray starts (pure config logic, called by
`fusedrl.config_checks.validate`). The trainer is `fusedrl.trainer.async_trainer.AsyncPPOTrainer`;
docs/placement.md ("Asynchronous training") has the user's view.

``async_training.max_staleness`` bounds how many actor updates a sample's policy may lag behind the actor
that trains on it: 0 is the synchronous run, 1 is one-step-off-policy (step k+1's samples are generated
while step k trains). Larger bounds are not built.
"""

from __future__ import annotations

from typing import Any

from fusedrl.placement_config import Placement

MAX_BUILT_STALENESS = 1
KEY = "async_training.max_staleness"


def max_staleness(cfg: Any) -> int:
    """``async_training.max_staleness`` as an int (0 when the value is not an integer: reported by
    `async_problems`)."""
    value = cfg.async_training.max_staleness
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return int(value)


def async_problems(cfg: Any, placement: Placement, problems: list[str]) -> None:
    """Append every problem of ``async_training`` against the run: a bound that is not 0 or 1, and, when
    it is 1, what one-step-off training needs (a rollout pool of its own, truncated importance weights
    against the rollout's own log-probs) and what it does not support (dynamic sampling, a greedy
    baseline, multi-turn agent loops)."""
    value = cfg.async_training.max_staleness
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        problems.append(f"`{KEY}`={value!r}: must be an integer >= 0 (0: synchronous, 1: one-step-off).")
        return
    if value > MAX_BUILT_STALENESS:
        problems.append(
            f"`{KEY}`={value}: only 0 (synchronous) and 1 (one-step-off-policy) are built; set {KEY}=1."
        )
        return
    if value == 0:
        return
    if not placement.rollout_apart:
        problems.append(
            f"`{KEY}`={value}: generation overlaps training only with the rollout on a pool of its own. Add "
            "`trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}` and "
            "`trainer.placement.roles={rollout: gen}`, or set "
            f"{KEY}=0."
        )
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is not in ("token", "sequence"):
        problems.append(
            f"`{KEY}`={value} needs truncated importance weights against the rollout's own log-probs (the "
            "behaviour policy is one update old): set `algorithm.rollout_correction.rollout_is=token` "
            f"(got {rc.rollout_is!r})."
        )
    if rc.bypass_mode:
        problems.append(
            f"`{KEY}`={value} with `algorithm.rollout_correction.bypass_mode`=true: bypass takes the rollout's "
            "log-probs as pi_old, so every importance weight pi_old / pi_rollout would be 1 and nothing would "
            "weigh the stale samples; set bypass_mode=false (the actor's own pass gives pi_old)."
        )
    if cfg.algorithm.filter_groups.enable:
        problems.append(
            f"`{KEY}`={value} with `algorithm.filter_groups.enable`=true: dynamic sampling generates a "
            "variable number of rounds per step, which one-step-off generation does not schedule; set "
            f"filter_groups.enable=false or {KEY}=0."
        )
    from fusedrl.algorithms import get_adv_traits, list_adv_estimators

    est = str(cfg.algorithm.adv_estimator)
    if est in list_adv_estimators() and get_adv_traits(est).needs_greedy_baseline:
        problems.append(
            f"`{KEY}`={value} with `algorithm.adv_estimator`={est}: its greedy baseline would be generated "
            f"by a newer policy than the samples; use another estimator or {KEY}=0."
        )
    multi_turn = cfg.actor_rollout_ref.rollout.get("multi_turn")
    if multi_turn is not None and multi_turn.enable:
        problems.append(
            f"`{KEY}`={value} with `actor_rollout_ref.rollout.multi_turn.enable`=true: multi-turn agent loops "
            f"are not supported asynchronously; set {KEY}=0."
        )
