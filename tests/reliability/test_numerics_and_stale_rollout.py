"""Bad numbers and stale rollout weights stop the run with a report instead of training on garbage."""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")


def _config(model, data, out, extra):
    from fusedrl.config import load_config

    return load_config(
        [
            f"data.train_files={data}",
            f"actor_rollout_ref.model.path={model}",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=5e-3",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=6",
            f"trainer.default_local_dir={out}",
            *extra,
        ]
    )


def _score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return (len(solution_str) % 3) / 2.0


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_nan_updates_are_skipped_then_stop(tiny_model_dir, arithmetic_data, tmp_path):
    import ray

    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import init_ray

    class NaNAdvantages(PPOTrainer):
        def compute_advantages(self, batch):
            batch = super().compute_advantages(batch)
            batch.advantages = torch.full_like(batch.advantages, float("nan"))
            return batch

    cfg = _config(tiny_model_dir, arithmetic_data[0], tmp_path, ["trainer.max_consecutive_skipped_steps=2"])
    init_ray(cfg)
    trainer = NaNAdvantages(cfg, compute_score=_score)
    try:
        trainer.init_workers()
        before = trainer.workers.run_all(lambda w: w.actor_state.remote())
        with pytest.raises(
            RuntimeError, match=r"last 2 optimizer steps were skipped.*Last good checkpoint: none"
        ):
            trainer.fit()
        after = trainer.workers.run_all(lambda w: w.actor_state.remote())
        assert trainer.global_step == 2
        for b, a in zip(before, after):  # the NaN never reached the weights
            assert all(torch.equal(b[k], a[k]) for k in b)
    finally:
        trainer.close()
        ray.shutdown()


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_stale_rollout_weights_stop_the_run(tiny_model_dir, arithmetic_data, tmp_path):
    import ray

    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import init_ray

    class ForgetsToSync(PPOTrainer):
        def sync_weights(self):
            return {}

    # The check runs on the steps whose rollout computes log-probs (calculate_log_probs=auto: 1, 2 and every
    # rollout_check_freq-th); step 1's update may leave the weights as they were (a group of equal scores).
    cfg = _config(tiny_model_dir, arithmetic_data[0], tmp_path, ["trainer.rollout_check_freq=3"])
    init_ray(cfg)
    trainer = ForgetsToSync(cfg, compute_score=_score)
    try:
        trainer.init_workers()
        with pytest.raises(RuntimeError, match="stale or corrupt weights"):
            trainer.fit()
        # step 1 is fine (engine built from the same files); then it diverges, seen on a check step
        assert trainer.global_step in (2, 3, 6), trainer.global_step
    finally:
        trainer.close()
        ray.shutdown()
