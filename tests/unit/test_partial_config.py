"""``async_training.partial_rollout`` and its two settings: checked before Ray starts, every problem named at
once with its key and fix; the trainer class follows the key; the groups kept in flight, hand-computed."""

from __future__ import annotations

import pytest
from support import small_grpo_config

from fusedrl.async_config import groups_in_flight
from fusedrl.config import ConfigError

ON = ["async_training.partial_rollout=true", "algorithm.rollout_correction.rollout_is=token"]


def _config(tiny_model_dir, arithmetic_data, *extra):
    return small_grpo_config(tiny_model_dir, arithmetic_data, *extra)


def _problems(tiny_model_dir, arithmetic_data, *extra) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _config(tiny_model_dir, arithmetic_data, *extra)
    return [p for p in err.value.problems if "partial_rollout" in p or "staleness_threshold" in p]


@pytest.mark.parametrize(
    ("batch", "threshold", "workers", "expected"),
    [
        (16, 0.1, 1, 18),  # 1.6 extra groups -> 2
        (16, 0.1, 4, 20),  # 2 extra -> 4: whole groups on each of 4 workers
        (8, 0.0, 2, 8),  # nothing extra: every group in flight is trained on
        (8, 0.5, 2, 12),
        (4, 0.25, 1, 5),  # exactly one extra group (no rounding up past it)
        (4, 1.0, 2, 8),
    ],
)
def test_groups_in_flight(batch, threshold, workers, expected):
    assert groups_in_flight(batch, threshold, workers) == expected


def test_trainer_class_follows_the_key(tiny_model_dir, arithmetic_data):
    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import trainer_class

    cfg = _config(tiny_model_dir, arithmetic_data)
    assert cfg.async_training.partial_rollout is False and trainer_class(cfg, None) is PPOTrainer
    on = _config(tiny_model_dir, arithmetic_data, *ON)
    assert trainer_class(on, None) is PartialRolloutTrainer
    with pytest.raises(ValueError, match=r"async_training.partial_rollout=true.*PartialRolloutTrainer"):
        trainer_class(on, PPOTrainer)

    class Mine(PartialRolloutTrainer):
        pass

    assert trainer_class(on, Mine) is Mine


def test_settings_without_partial_rollout_are_refused(tiny_model_dir, arithmetic_data):
    problems = _problems(
        tiny_model_dir,
        arithmetic_data,
        "async_training.staleness_threshold=0.5",
        "async_training.partial_rollout_max_resumes=1",
    )
    assert len(problems) == 2, problems
    assert all("read only with `async_training.partial_rollout`=true" in p for p in problems)
    (bad,) = _problems(tiny_model_dir, arithmetic_data, *ON, "async_training.staleness_threshold=-1")
    assert "must be a number >= 0" in bad


def test_every_partial_rollout_problem_is_named_at_once(tiny_model_dir, arithmetic_data):
    problems = _problems(
        tiny_model_dir,
        arithmetic_data,
        "async_training.partial_rollout=true",  # and no importance weights
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
        "trainer.placement.roles={rollout: gen}",
        "async_training.max_staleness=1",
        "actor_rollout_ref.rollout.name=hf",
        "algorithm.filter_groups.enable=true",
    )
    text = "\n".join(problems)
    assert "fused pool" in text and "max_staleness`=1 (one-step-off)" in text
    assert "choose one of the two" in text
    assert "rollout.name`=hf" in text and "cannot pause" in text
    assert "rollout_correction.rollout_is=token" in text
    assert "filter_groups.enable=false or async_training.partial_rollout=false" in text


def test_groups_must_split_whole_over_the_workers(tiny_model_dir, arithmetic_data):
    problems = _problems(
        tiny_model_dir,
        arithmetic_data,
        *ON,
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3",
    )
    assert any("do not split whole over 2 rollout workers" in p for p in problems), problems


def test_partial_rollout_with_importance_weights_loads(tiny_model_dir, arithmetic_data):
    cfg = _config(tiny_model_dir, arithmetic_data, *ON, "async_training.staleness_threshold=0.5")
    assert cfg.async_training.partial_rollout and cfg.async_training.staleness_threshold == 0.5


def test_multi_turn_agent_loops_load_on_the_continuous_schedule_only(tiny_model_dir, arithmetic_data):
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = _config(tiny_model_dir, arithmetic_data, *ON, f"{mt}.enable=true")
    assert cfg.async_training.partial_rollout and cfg.actor_rollout_ref.rollout.multi_turn.enable
    (bad,) = _problems(tiny_model_dir, arithmetic_data, *ON, f"{mt}.enable=true", f"{mt}.schedule=turn_sync")
    assert (
        f"`{mt}.schedule`=turn_sync" in bad
        and "set schedule=continuous or async_training.partial_rollout=false" in bad
    )
