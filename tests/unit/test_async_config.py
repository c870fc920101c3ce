"""``async_training.max_staleness``: checked before Ray starts, every problem named at once with its key and
the fix; the trainer class follows the key."""

from __future__ import annotations

import pytest
from support import small_grpo_config

from fusedrl.config import ConfigError

GEN = [
    "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
    "trainer.placement.roles={rollout: gen}",
]
CORRECTED = ["algorithm.rollout_correction.rollout_is=token"]


def _config(tiny_model_dir, arithmetic_data, *extra):
    return small_grpo_config(tiny_model_dir, arithmetic_data, *extra)


def _problems(tiny_model_dir, arithmetic_data, *extra) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _config(tiny_model_dir, arithmetic_data, *extra)
    return [p for p in err.value.problems if "async_training" in p]


def test_default_is_synchronous(tiny_model_dir, arithmetic_data):
    from fusedrl.trainer.async_trainer import AsyncPPOTrainer
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import trainer_class

    cfg = _config(tiny_model_dir, arithmetic_data)
    assert cfg.async_training.max_staleness == 0
    assert trainer_class(cfg, None) is PPOTrainer
    one = _config(tiny_model_dir, arithmetic_data, *GEN, *CORRECTED, "async_training.max_staleness=1")
    assert trainer_class(one, None) is AsyncPPOTrainer
    # A user's subclass must be an async one when the key asks for async training.
    with pytest.raises(ValueError, match=r"async_training.max_staleness=1.*AsyncPPOTrainer"):
        trainer_class(one, PPOTrainer)


def test_staleness_bounds_above_one_load_and_negative_is_refused(tiny_model_dir, arithmetic_data):
    for k in (2, 4):
        cfg = _config(tiny_model_dir, arithmetic_data, *GEN, *CORRECTED, f"async_training.max_staleness={k}")
        assert cfg.async_training.max_staleness == k
    (neg,) = _problems(tiny_model_dir, arithmetic_data, "async_training.max_staleness=-1")
    assert "integer >= 0" in neg


def test_async_needs_a_rollout_pool_and_importance_weights(tiny_model_dir, arithmetic_data):
    problems = _problems(tiny_model_dir, arithmetic_data, "async_training.max_staleness=1")
    assert len(problems) == 2, problems
    pool, weights = problems
    assert "pool of its own" in pool and "trainer.placement.roles={rollout: gen}" in pool
    assert "rollout_correction.rollout_is=token" in weights


def test_every_async_problem_is_named_at_once(tiny_model_dir, arithmetic_data):
    problems = _problems(
        tiny_model_dir,
        arithmetic_data,
        *GEN,
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.filter_groups.enable=true",
        "algorithm.adv_estimator=remax",
    )
    text = "\n".join(problems)
    assert len(problems) == 3, problems
    assert "set bypass_mode=false" in text
    assert "filter_groups.enable=false" in text
    assert "adv_estimator`=remax" in text


def test_one_step_off_config_is_accepted(tiny_model_dir, arithmetic_data):
    cfg = _config(tiny_model_dir, arithmetic_data, *GEN, *CORRECTED, "async_training.max_staleness=1")
    assert cfg.async_training.max_staleness == 1
