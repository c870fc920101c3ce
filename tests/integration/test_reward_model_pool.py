"""A reward model on a pool of its own scores while the actor computes log-probs (trainer/reward_scoring.py).

One training worker (actor + rollout, pool `global`) and one reward-model worker (pool `rm`). The scoring is
sent after the batch is balanced and awaited before the advantages: the driver computes the actor's old
log-probs in between. The scores must equal the classifier applied by hand to the step's own samples, in
their final row order.
"""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_reward_model_on_its_own_pool_scores_during_log_probs(tiny_model_dir, arithmetic_data, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fusedrl.trainer.ppo_trainer import PPOTrainer

    rm_dir = str(tmp_path / "rm")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)

    class Keep(PPOTrainer):
        """Keeps each step's batch as the advantages saw it, and the order of the phases."""

        batches: list = []
        order: list[str] = []

        def submit_reward_model_scores(self, batch):
            self.order.append("rm_sent")
            super().submit_reward_model_scores(batch)

        def compute_log_probs(self, batch):
            self.order.append("log_probs")
            return super().compute_log_probs(batch)

        def await_reward_model_scores(self, batch, metrics):
            self.order.append("rm_awaited" if self._rm_pending is not None else "none")
            return super().await_reward_model_scores(batch, metrics)

        def compute_advantages(self, batch):
            self.batches.append(batch.clone())
            return super().compute_advantages(batch)

    overrides = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dir}",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.actor.old_log_prob_from_update=false",  # the actor's own old-log-prob pass runs
        "data.train_batch_size=2",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=2",
        "trainer.placement.pools={rm: {nnodes: 1, n_gpus_per_node: 1}}",
        "trainer.placement.roles={reward_model: rm}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    with started_trainer(overrides, trainer_cls=Keep, compute_score=None) as trainer:
        assert trainer.group_for("reward_model") is not trainer.group_for("actor")
        assert trainer.reward_model_overlaps
        steps = []
        for trainer.global_step in (1, 2):
            steps.append(trainer.train_step())
        (rm_events,) = trainer.group_for("reward_model").run_all(lambda w: w.get_events.remote())
    assert trainer.order == ["rm_sent", "log_probs", "rm_awaited"] * 2
    assert not any(e.startswith(("actor.", "rollout.")) for e in rm_events)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1, dtype=torch.float32).eval()
    for batch, m in zip(trainer.batches, steps):
        ids, attn, pos = batch.sequences()
        with torch.no_grad():
            hidden = rm.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
            last = batch.prompts.shape[1] + batch.response_mask.sum(-1) - 1
            expected = rm.score(hidden[torch.arange(ids.shape[0]), last]).squeeze(-1)  # [B]
        got = batch.token_level_scores.sum(-1)
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)
        assert m["reward/rm_score/mean"] == pytest.approx(float(expected.mean()), abs=1e-5)
        # The driver ran the actor's log-prob pass while the reward model scored.
        assert m["timing_s/reward_model_overlap"] >= m["timing_s/old_log_prob"] > 0
