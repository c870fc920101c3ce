"""A killed-and-resumed agentic run equals an uninterrupted one (multi-turn environment rollouts with
deterministic environments; per-turn seeds derive from the row seed and the turn index)."""

from __future__ import annotations

import os

import pytest
import torch
from support import FLOAT32_TRAINING, metrics_by_step, varied_score

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

PLUGIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "agent_plugins.py")


def _config(model, data, out_dir, steps: int):
    from fusedrl.config import load_config

    return load_config(
        [
            f"data.train_files={data}",
            f"actor_rollout_ref.model.path={model}",
            f"algorithm.custom_modules=[{PLUGIN}]",
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=2",
            "data.max_prompt_length=256",
            "data.max_response_length=96",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.default_agent_name=plugin_count_env",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.n_gpus_per_node=1",
            "trainer.val_before_train=false",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={out_dir}",
        ]
    )


def _run(cfg):
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(cfg, compute_score=varied_score)
    try:
        trainer.init_workers()
        trainer.fit()
        state = trainer.workers.run_all(lambda w: w.actor_state.remote())
    finally:
        trainer.close()
    return trainer, state


def test_agentic_resume_equals_uninterrupted(ray_cluster, tiny_model_dir, arithmetic_data, tmp_path):
    train = arithmetic_data[0]
    _, full_state = _run(_config(tiny_model_dir, train, tmp_path / "a", 3))
    _run(_config(tiny_model_dir, train, tmp_path / "b", 2))  # "killed" after the step-2 checkpoint
    resumed, resumed_state = _run(_config(tiny_model_dir, train, tmp_path / "b", 3))
    assert resumed.global_step == 3
    a, b = metrics_by_step(tmp_path / "a"), metrics_by_step(tmp_path / "b")
    assert sorted(b) == [1, 2, 3]
    for key in (
        "critic/score/mean",
        "response_length/mean",
        "agent/observation_tokens/mean",
        "agent/reward/mean",
    ):
        assert a[3][key] == pytest.approx(b[3][key], abs=1e-6), key
    assert a[3]["agent/assistant_turns/mean"] == 3.0
    for rank_a, rank_b in zip(full_state, resumed_state):
        for name in rank_a:
            assert torch.allclose(rank_a[name], rank_b[name], atol=1e-5, rtol=0), name
