"""Reward-model scoring of the PPO trainer (``reward_model.enable``), in line or overlapped.

Where the reward model shares the actor's workers it scores in line, right after generation. Placed on a
pool of its own (``trainer.placement.roles={reward_model: rm}``, docs/placement.md) its workers are idle
while the actor computes log-probs, so the scoring is sent (not awaited) once the batch's row order is
final (after `balance_batch`) and awaited only when the scores are first read (the in-reward KL penalty or
the advantages): the reward model's forward runs while the actor, the reference and the critic compute
theirs. Not when the scores are needed at once: dynamic sampling (``algorithm.filter_groups``) filters on
them and ReMax scores its greedy baseline with them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fusedrl.batch import RolloutBatch, on_last_sampled_token
from fusedrl.controller.worker_group import Submitted, WorkerGroup
from fusedrl.metrics import Metrics
from fusedrl.role_config import RoleConfigs


class RewardModelScoring:
    """The reward-model steps of `PPOTrainer` (a mixin: it reads the trainer's typed config and worker groups)."""

    run: RoleConfigs
    adv_traits: Any
    _rm_pending: tuple[Submitted, RolloutBatch, float] | None = None

    if TYPE_CHECKING:

        def group_for(self, role: str) -> WorkerGroup: ...

        def _model_inputs(self, batch: RolloutBatch) -> RolloutBatch: ...

    @property
    def reward_model_overlaps(self) -> bool:
        """Whether the reward model scores on workers of its own while the actor works (module docstring)."""
        if not self.run.reward_model.enable or self.group_for("reward_model") is self.group_for("actor"):
            return False
        return not self.run.algorithm.filter_groups.enable and not self.adv_traits.needs_greedy_baseline

    def compute_reward_model_scores(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        """Sequence scores from the reward-model role, placed on each response's last sampled token."""
        self.submit_reward_model_scores(batch)
        return self.await_reward_model_scores(batch, metrics)

    def submit_reward_model_scores(self, batch: RolloutBatch) -> None:
        """Send the batch to the reward-model workers without waiting (rows in their final order)."""
        inputs = self._model_inputs(batch)
        rm, sp = self.group_for("reward_model"), self.run.reward_model.ulysses_sequence_parallel_size
        sent = rm.submit_split(lambda w, s: w.reward_model_compute_scores.remote(s), inputs, replicas=sp)
        self._rm_pending = (sent, inputs, time.monotonic())

    def await_reward_model_scores(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        """The scores sent for by `submit_reward_model_scores` into ``batch`` (a no-op when none were);
        ``timing_s/reward_model_overlap``: how long the driver did other work while they were computed."""
        if self._rm_pending is None:
            return batch
        (sent, inputs, since), self._rm_pending = self._rm_pending, None
        metrics["timing_s/reward_model_overlap"] = time.monotonic() - since
        rm = self.group_for("reward_model")
        seq_scores = rm.gather_tensors(rm.wait(sent), inputs)  # [B]
        batch.token_level_scores = on_last_sampled_token(seq_scores, batch.response_mask)  # [B, Tr]
        batch.token_level_rewards = batch.token_level_scores.clone()
        metrics["reward/rm_score/mean"] = float(seq_scores.mean())
        return batch
