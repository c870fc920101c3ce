"""The actor's old-log-prob pass and update as the PPO trainer calls them (`PPOTrainer.compute_log_probs`,
`PPOTrainer.update_actor`), and where their log-probs go (issue 39 item 3: data stays where it was made).

Where a training generation left its ``rollout_log_probs`` on the workers (`step_plan.rollout_log_probs_stay`:
the driver computes nothing on them but the step's ``rollout/log_prob_abs_diff_*``), the old log-probs stay
there too: the separate pass keeps them for the update (``keep``), the update's own forward uses them, and
either answers the gap between the two as numbers (`fusedrl.log_prob_gap`), which
`PPOTrainer.batch_metrics` reports: the values the driver computes from the tensors on the transfer path.
Otherwise (rollout correction, bypass mode, the in-reward KL, the optimal token baseline, a rollout pool, the
async and partial-rollout trainers, a batch generated outside a training step) both come back as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusedrl.algorithms.rollout_correction import correct_batch
from fusedrl.batch import RolloutBatch
from fusedrl.lr_schedule import scheduled_lr
from fusedrl.metrics import Metrics, mean_over_ranks
from fusedrl.trainer import step_plan

if TYPE_CHECKING:
    from fusedrl.trainer.ppo_trainer import PPOTrainer


def log_probs_stayed(trainer: PPOTrainer, batch: RolloutBatch) -> bool:
    """Whether the batch's rollout log-probs stayed on the workers that sampled them (not on the driver; a
    rollout that computed none, `step_plan.rollout_log_probs_wanted`, left none anywhere)."""
    return batch.rollout_log_probs is None and trainer.resident.holds(batch, "rollout_log_probs")


def compute_log_probs(trainer: PPOTrainer, batch: RolloutBatch) -> RolloutBatch:
    """`PPOTrainer.compute_log_probs`: the actor's old log-probs of the batch's samples (module docstring)."""
    if trainer.run.algorithm.rollout_correction.bypass_mode:
        batch.old_log_probs = batch.rollout_log_probs.clone()
        return batch
    t, inputs = trainer.temperature, batch.model_input_fields()
    actor = trainer.group_for("actor")
    actor.send_all(lambda w: w.load_actor.remote())  # a no-op after a rollout (it brought them back)
    spp, sp = trainer.adv_traits.needs_sum_pi_squared, trainer.actor_sp
    call = lambda w, s: w.actor_compute_log_prob.remote(s, t, spp)  # noqa: E731
    if log_probs_stayed(trainer, batch):  # kept there for the update; the gap comes back
        trainer.resident.run_split(actor, call, batch, inputs, sp, keep="old_log_probs", gap=True)
        return batch
    parts = trainer.resident.run_split(actor, call, batch, inputs, sp)
    if spp:  # (log-probs, Σπ²) pairs from the same forwards (optimal token baseline)
        batch.sum_pi_squared = actor.gather_tensors([p[1] for p in parts], batch)
        parts = [p[0] for p in parts]
    batch.old_log_probs = actor.gather_tensors(parts, batch)
    return batch


def update_actor(trainer: PPOTrainer, batch: RolloutBatch) -> Metrics:
    """`PPOTrainer.update_actor`: the PPO update of the policy on the fused workers; where neither the driver
    nor the workers hold old log-probs, the update's own forward gives them (`old_log_probs_reusable`)."""
    from_forward = batch.old_log_probs is None and not trainer.resident.holds(batch, "old_log_probs")
    fields = [
        *batch.model_input_fields(),
        *step_plan.update_fields(trainer.run, old_from_forward=from_forward),
    ]
    t = trainer.temperature
    # The actor's schedule starts when it starts training (after trainer.critic_warmup steps).
    step = trainer.global_step - 1 - trainer.run.trainer.critic_warmup
    lr = scheduled_lr(trainer.run.actor.optim, step, trainer.total_steps)
    actor, sp = trainer.group_for("actor"), trainer.actor_sp
    # The optimizer state is on the device only for the update.
    actor.send_all(lambda w: w.load_actor.remote(optimizer=True))
    if from_forward:
        call = lambda w, s: w.actor_update_old_from_forward.remote(s, t, lr)  # noqa: E731
        gap = log_probs_stayed(trainer, batch)  # then the workers answer the gap, not the old log-probs
        pairs = trainer.resident.run_split(actor, call, batch, fields, sp, gap=gap)
        if not gap:
            batch.old_log_probs = actor.gather_tensors([p[1] for p in pairs], batch)  # [B, Tr]
            # the advantages the loss corrected (its rollout_corr/* metrics came with the update's)
            correct_batch(batch, trainer.run.algorithm.rollout_correction, {})
        per_rank = [p[0] for p in pairs]
    else:
        call = lambda w, s: w.actor_update.remote(s, t, lr)  # noqa: E731
        per_rank = trainer.resident.run_split(actor, call, batch, fields, sp)
    actor.send_all(lambda w: w.offload_actor.remote(params=False, optimizer=True))
    return mean_over_ranks(per_rank)
