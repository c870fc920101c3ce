"""A reward model fused into the workers scores the samples; user plugins register an estimator and a
policy loss by module path, and the run uses them (in the driver and in the workers)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from support import FLOAT32_TRAINING

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")

PLUGIN = textwrap.dedent(
    '''
    import torch
    from fusedrl.algorithms import get_policy_loss, register_adv_estimator, register_policy_loss

    CALLS = {"loss": 0}

    @register_adv_estimator("plugin_sign")
    def sign_advantage(token_level_rewards, response_mask, index=None, **kwargs):
        """+1 for samples scoring above the batch mean, -1 below."""
        scores = (token_level_rewards * response_mask).sum(-1)  # [B]
        adv = torch.sign(scores - scores.mean()).unsqueeze(-1) * response_mask  # [B, T]
        return adv, adv

    @register_policy_loss("plugin_vanilla_x2")
    def doubled(log_prob, old_log_prob, advantages, response_mask, **kwargs):
        loss, metrics = get_policy_loss("vanilla")(log_prob, old_log_prob, advantages, response_mask, **kwargs)
        metrics["plugin_marker"] = torch.tensor(7.0)
        return 2.0 * loss, metrics
    '''
)


def test_reward_model_role_and_plugins(tiny_model_dir, arithmetic_data, tmp_path):
    import ray
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fusedrl.config import load_config
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import init_ray

    rm_dir = str(tmp_path / "rm")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(PLUGIN)

    cfg = load_config(
        [
            f"data.train_files={arithmetic_data[0]}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "reward_model.enable=true",
            f"reward_model.model.path={rm_dir}",
            f"algorithm.custom_modules=[{plugin}]",
            "algorithm.adv_estimator=plugin_sign",
            "actor_rollout_ref.actor.policy_loss.loss_mode=plugin_vanilla_x2",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    init_ray(cfg)
    trainer = PPOTrainer(cfg)
    try:
        trainer.init_workers()
        batch = trainer.compute_rewards(trainer.generate(trainer.next_prompts()), {})
        # The fused reward model's scores equal the classifier applied by hand at the last response token.
        rm = AutoModelForSequenceClassification.from_pretrained(
            rm_dir, num_labels=1, dtype=torch.float32
        ).eval()
        ids, attn, pos = batch.sequences()
        with torch.no_grad():
            hidden = rm.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
            last = batch.prompts.shape[1] + batch.response_mask.sum(-1) - 1
            expected = rm.score(hidden[torch.arange(ids.shape[0]), last]).squeeze(-1)
        got = batch.token_level_scores.sum(-1)
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)

        metrics = trainer.fit()
        assert metrics["actor/plugin_marker"] == pytest.approx(7.0)  # the plugin loss ran in the workers
        assert math.isfinite(metrics["actor/pg_loss"]) and "reward/rm_score/mean" in metrics
    finally:
        trainer.close()
        ray.shutdown()
