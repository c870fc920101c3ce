"""``async_training``, read and checked before Ray starts (pure config logic, called by
`fusedrl.config_checks.validate`). The trainer is `fusedrl.trainer.async_trainer.AsyncPPOTrainer`;
docs/placement.md ("Asynchronous training") has the user's view.

``async_training.max_staleness`` bounds how many actor updates a sample's policy may lag behind the actor
that trains on it: 0 is the synchronous run, 1 is one-step-off-policy (step k+1's samples are generated
while step k trains), K keeps the generations of the next K steps in flight. ``async_training.partial_rollout``
is partial rollout in the fused pool (`fusedrl.trainer.partial_trainer`).
"""

from __future__ import annotations

import math
from typing import Any

from fusedrl.placement_config import Placement

KEY = "async_training.max_staleness"
PARTIAL = "async_training.partial_rollout"
THRESHOLD = "async_training.staleness_threshold"
MAX_RESUMES = "async_training.partial_rollout_max_resumes"


def max_staleness(run: Any) -> int:
    """``async_training.max_staleness`` of the typed sections ``run`` as an int (0 when the value is not an
    integer: reported by `AsyncTrainingConfig.problems`)."""
    value = run.async_training.max_staleness
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return int(value)


def groups_in_flight(train_batch_size: int, staleness_threshold: float, workers: int) -> int:
    """Prompt groups a partial-rollout run keeps in flight: a step's ``train_batch_size`` plus
    ``staleness_threshold`` of it (verl's meaning: the extra share generated beyond what a step trains on),
    the extra rounded up to whole groups on every rollout worker."""
    extra = math.ceil(train_batch_size * staleness_threshold - 1e-9)
    extra += (-extra) % workers
    return train_batch_size + extra


def partial_rollout_problems(run: Any, placement: Placement, problems: list[str]) -> None:
    """Append every problem of ``async_training.partial_rollout`` and its two settings against the run:
    partial rollout runs in the fused pool (the engine in the actor's processes), one engine per worker
    (no tensor parallelism), on an engine that can pause requests, on groups split whole over the workers;
    what stale samples need (`stale_sample_problems`); agent loops (``multi_turn``) on the continuous
    schedule (`fusedrl.workers.rollout.partial_agent`). The keys' own values (and the two settings refused
    when it is off): `fusedrl.role_config.AsyncTrainingConfig.problems`. ``run``: the typed sections."""
    if run.async_training.partial_rollout is not True:  # its own values: `AsyncTrainingConfig.problems`
        return
    setting, off = f"`{PARTIAL}`=true", f"{PARTIAL}=false"
    if placement.rollout_apart:
        problems.append(
            f"{setting}: partial rollout runs in the fused pool (the engine in the actor's processes); with "
            f"the rollout on a pool of its own use `{KEY}`=1 (one-step-off), or drop the rollout's pool."
        )
    if max_staleness(run):
        problems.append(f"{setting} with `{KEY}`={max_staleness(run)}: choose one of the two; set {KEY}=0.")
    rollout = run.rollout
    if int(rollout.tensor_model_parallel_size) > 1:
        problems.append(
            f"{setting} with `actor_rollout_ref.rollout.tensor_model_parallel_size`="
            f"{rollout.tensor_model_parallel_size}: one engine per worker only for now; set it to 1 or {off}."
        )
    from fusedrl.workers.rollout.registry import engine_names, engine_traits

    if rollout.name in engine_names() and not engine_traits(rollout.name).request_queue:
        problems.append(
            f"{setting} with `actor_rollout_ref.rollout.name`={rollout.name}: that engine cannot pause a "
            f"request half-way; use vllm, or {off}."
        )
    bsz, workers = run.data.train_batch_size, placement.world_of("rollout")
    if isinstance(bsz, int) and bsz > 0 and bsz % workers:
        problems.append(
            f"{setting}: `data.train_batch_size`={bsz} prompt groups do not split whole over {workers} rollout "
            f"workers (a group's samples stay on one engine); use a multiple of {workers}."
        )
    stale_sample_problems(run, setting, off, problems, multi_turn=True)
    agent = rollout.multi_turn
    if agent.enable and agent.schedule != "continuous":
        problems.append(
            f"{setting} with `actor_rollout_ref.rollout.multi_turn.schedule`={agent.schedule}: partial rollout "
            f"of agent loops runs the continuous schedule only; set schedule=continuous or {off}."
        )


def async_problems(run: Any, placement: Placement, problems: list[str]) -> None:
    """Append every problem of ``async_training.max_staleness`` against the run (a bound that is not an
    integer >= 0: `fusedrl.role_config.AsyncTrainingConfig.problems`): when it is > 0, what asynchronous
    training needs (a rollout pool of its own,
    truncated importance weights against the rollout's own log-probs) and what it does not support
    (dynamic sampling, a greedy baseline). ``run``: the typed sections."""
    value = run.async_training.max_staleness
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:  # < 0: its section's problem
        return
    if not placement.rollout_apart:
        problems.append(
            f"`{KEY}`={value}: generation overlaps training only with the rollout on a pool of its own. Add "
            "`trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}` and "
            "`trainer.placement.roles={rollout: gen}`, or set "
            f"{KEY}=0."
        )
    stale_sample_problems(run, f"`{KEY}`={value}", f"{KEY}=0", problems, multi_turn=True)


def stale_sample_problems(
    run: Any, setting: str, off: str, problems: list[str], *, multi_turn: bool = False
) -> None:
    """What training on samples of an older policy needs (truncated importance weights against the
    rollout's own log-probs, the actor's own pass for pi_old) and refuses (dynamic sampling, a greedy
    baseline, and multi-turn agent loops unless ``multi_turn``): one problem each, naming ``setting`` and
    the way to turn it ``off``."""
    from fusedrl.algorithms.rollout_correction import IS_LEVELS

    rc = run.algorithm.rollout_correction
    if rc.rollout_is not in IS_LEVELS:
        problems.append(
            f"{setting} needs truncated importance weights against the rollout's own log-probs (the "
            "behaviour policy is older than the actor): set `algorithm.rollout_correction.rollout_is=token` "
            f"(got {rc.rollout_is!r})."
        )
    if rc.bypass_mode:
        problems.append(
            f"{setting} with `algorithm.rollout_correction.bypass_mode`=true: bypass takes the rollout's "
            "log-probs as pi_old, so every importance weight pi_old / pi_rollout would be 1 and nothing would "
            "weigh the stale samples; set bypass_mode=false (the actor's own pass gives pi_old)."
        )
    if run.algorithm.filter_groups.enable:
        problems.append(
            f"{setting} with `algorithm.filter_groups.enable`=true: dynamic sampling generates a variable "
            f"number of rounds per step, which this schedule does not plan; set filter_groups.enable=false "
            f"or {off}."
        )
    from fusedrl.algorithms import get_adv_traits, list_adv_estimators

    est = str(run.algorithm.adv_estimator)
    if est in list_adv_estimators() and get_adv_traits(est).needs_greedy_baseline:
        problems.append(
            f"{setting} with `algorithm.adv_estimator`={est}: its greedy baseline would be generated "
            f"by a newer policy than the samples; use another estimator or {off}."
        )
    if not multi_turn and run.rollout.multi_turn.enable:
        problems.append(
            f"{setting} with `actor_rollout_ref.rollout.multi_turn.enable`=true: multi-turn agent loops "
            f"are not supported here yet; set {off}."
        )
