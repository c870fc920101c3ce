"""The fallback rollout (Hugging Face generate on the actor's own FSDP2 module) runs a GRPO step."""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING

pytestmark = pytest.mark.integration


def test_hf_rollout_grpo_step(tiny_model_dir, arithmetic_data, tmp_path):
    import ray

    from fusedrl.config import load_config
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import init_ray

    cfg = load_config(
        [
            f"data.train_files={arithmetic_data[0]}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.rollout.name=hf",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.temperature=0.9",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    init_ray(cfg)
    trainer = PPOTrainer(
        cfg, compute_score=lambda data_source, solution_str, ground_truth, extra_info=None: 0.5
    )
    try:
        trainer.init_workers()
        prompts = next(iter(trainer.train_loader))
        batch = trainer.compute_log_probs(trainer.generate(prompts))
        mask = batch.response_mask.bool()
        assert mask.any()
        # Ranks generate different lengths: synced generation must still finish, and the engine's
        # log-probs are the actor's (same module).
        assert float((batch.rollout_log_probs - batch.old_log_probs).abs()[mask].max()) < 1e-5
        eos = trainer.tokenizer.eos_token_id
        for row, m in zip(batch.responses, batch.response_mask):
            ids = row[m.bool()].tolist()
            assert eos not in ids[:-1], "tokens after EOS were kept"
        metrics = trainer.fit()
        assert trainer.global_step == 1
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        assert metrics["timing_s/sync_weights"] >= 0
    finally:
        trainer.close()
        ray.shutdown()
