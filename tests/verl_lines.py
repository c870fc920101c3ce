"""The command-line base shared by the verl-compat unit tests: the options every verl example script sets
(data, model, actor, rollout, trainer) over the tiny local files of the ``files`` fixture
(tests/unit/conftest.py), and the keys a rejected config's problems name."""

from __future__ import annotations

import pytest

from fusedrl.config import ConfigError, load_config


def common_overrides(f: dict[str, str]) -> list[str]:
    return [
        f"data.train_files={f['train']}",
        f"data.val_files={f['test']}",
        "data.train_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"actor_rollout_ref.model.path={f['model']}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "trainer.critic_warmup=0",
        "trainer.logger=['console']",
        "trainer.project_name=verl_example",
        "trainer.experiment_name=tiny",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=5",
        "trainer.total_epochs=1",
    ]


def problems_of(overrides: list[str]) -> list[str]:
    """The problems of the `ConfigError` that ``overrides`` must raise."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    return list(info.value.problems)


def problem_keys(overrides: list[str]) -> list[str]:
    """The keys named (between backticks, first in each problem) by the `ConfigError` that ``overrides`` raise."""
    return sorted(p.split("`")[1] for p in problems_of(overrides))
