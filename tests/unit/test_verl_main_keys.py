"""verl main's (2026-08) layout loads: its example-script families, both layouts' names of one setting, other
engines, trainer modes, refused features, ``ray_kwargs.ray_init`` and the file logger."""

from __future__ import annotations

from pathlib import Path

import pytest
from verl_lines import common_overrides as _common
from verl_lines import problem_keys, problems_of

from fusedrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


# --- verl main (2026-08) layout: the same families as verl's current example scripts write them
# (examples/{ppo_trainer,grpo_trainer,tuning/lora}/*_fsdp.sh, the DAPO overlong buffer through reward.*).
UV_LINE = "ray_kwargs.ray_init.runtime_env.py_executable=null"
MAIN_FAMILIES: dict[str, list[str]] = {
    "ppo": [
        "algorithm.adv_estimator=gae",
        "critic.model.use_remove_padding=True",
        "critic.model.enable_gradient_checkpointing=True",
        "critic.optim.lr=1e-5",
        "critic.use_dynamic_bsz=True",
        "critic.ppo_max_token_len_per_gpu=2048",
        "critic.fsdp.param_offload=True",
        "critic.fsdp.optimizer_offload=True",
        "critic.fsdp.fsdp_size=-1",
        "trainer.use_v1=True",
        "trainer.v1.trainer_mode=sync",
        "model_engine=dp",
        UV_LINE,
    ],
    "grpo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "reward.reward_manager.name=naive",
        "reward.num_workers=2",
        "reward.custom_reward_function.path=REWARD_FILE",
        "reward.custom_reward_function.name=my_score",
        "+reward.reward_kwargs.format_score=0.1",
        "+ray_kwargs.ray_init.num_gpus=0",
        "+ray_kwargs.ray_init.runtime_env.env_vars.FUSEDRL_TEST_VAR=1",
        "ray_kwargs.ray_init.num_cpus=3",
        UV_LINE,
        "trainer.logger=['console','file']",
    ],
    "dapo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "data.gen_batch_size=12",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
        "+reward.reward_kwargs.max_resp_len=16",
        UV_LINE,
    ],
    "lora": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.model.lora_rank=16",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True",
        "trainer.val_before_train=False",
        UV_LINE,
    ],
}


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "score.py"
    path.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0):\n"
        "    return 1.0 if str(ground_truth) in solution_str else format_score\n"
    )
    return str(path)


def _main_line(files, reward_file, family: str) -> list[str]:
    return [*_common(files), *(ov.replace("REWARD_FILE", reward_file) for ov in MAIN_FAMILIES[family])]


@pytest.mark.parametrize("family", sorted(MAIN_FAMILIES))
def test_verl_main_command_line_loads(files, reward_file, family):
    lines: list[str] = []
    # the composed config (RunConfig.source): where each verl key landed, free-form mappings included
    cfg = load_config(_main_line(files, reward_file, family), report=lines.append).source  # no ConfigError
    assert len(lines) <= 1
    said = lines[0] if lines else ""
    assert "unknown" not in said
    if family == "ppo":  # critic.fsdp.* is the critic's FSDP section
        fsdp = cfg.critic.model.fsdp_config
        assert fsdp.param_offload is True and fsdp.optimizer_offload is True
        assert cfg.async_training.max_staleness == 0
        assert "critic.fsdp.fsdp_size" in said and "model_engine" in said
        assert cfg.trainer.ray_init.runtime_env.py_executable is None
    if family == "grpo":  # reward.* lands on the reward code's keys; ray_kwargs on ray.init's
        assert cfg.reward_model.reward_manager == "naive" and cfg.reward_model.num_workers == 2
        assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == (reward_file, "my_score")
        assert cfg.reward_model.reward_kwargs.format_score == 0.1
        assert cfg.trainer.ray_init.num_gpus == 0 and cfg.trainer.ray_num_cpus == 3
        assert cfg.trainer.ray_init.runtime_env.env_vars.FUSEDRL_TEST_VAR == 1
        assert list(cfg.trainer.logger) == ["console", "file"]
        assert "format_score" not in said and "ray_init" not in said
    if family == "dapo":  # the overlong buffer reaches the DAPO manager through reward.reward_kwargs
        ob = cfg.reward_model.overlong_buffer
        assert (ob.enable, ob.len, ob.penalty_factor, ob.max_resp_len) == (True, 4, 0.5, 16)
        assert "overlong_buffer_cfg" not in cfg.reward_model.reward_kwargs
        assert "overlong_buffer_cfg.log" in said
        from fusedrl.rewards import DAPORewardManager, build_reward_manager

        manager = build_reward_manager(cfg, tokenizer=None)
        assert isinstance(manager, DAPORewardManager)
        assert (manager.overlong_buffer_enable, manager.overlong_buffer_len) == (True, 4)
        assert (manager.overlong_penalty_factor, manager.max_response_length) == (0.5, 16)
    if family == "lora":
        assert cfg.actor_rollout_ref.model.lora_rank == 16
        assert "layered_summon" in said


def test_unread_nested_plus_keys_are_reported(files):
    lines: list[str] = []
    cfg = load_config(
        [
            *_common(files),
            "reward.reward_manager.name=dapo",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
            "+reward.reward_kwargs.overlong_buffer_cfg.soft_cap=2",
            "+critic.fsdp.made_up=1",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
        ],
        report=lines.append,
    )
    assert cfg.reward_model.overlong_buffer.enable is True
    assert len(lines) == 1
    assert "reward.reward_kwargs.overlong_buffer_cfg.soft_cap (not an overlong-buffer setting" in lines[0]
    assert "critic.fsdp.made_up (added with +, but nothing in fusedrl reads it)" in lines[0]
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space" in lines[0]
    assert "soft_cap" not in cfg.reward_model.reward_kwargs.get("overlong_buffer_cfg", {})


def test_one_setting_under_both_layouts_is_an_error_naming_both(files):
    problems = problems_of(
        [
            *_common(files),
            "reward_model.reward_manager=naive",
            "reward.reward_manager.name=dapo",
            "critic.model.fsdp_config.param_offload=False",
            "critic.fsdp.param_offload=True",
            "custom_reward_function.name=a",
            "reward.custom_reward_function.name=b",
        ]
    )
    assert len(problems) == 3, problems
    for old, new in (
        ("reward_model.reward_manager", "reward.reward_manager.name"),
        ("critic.model.fsdp_config.param_offload", "critic.fsdp.param_offload"),
        ("custom_reward_function.name", "reward.custom_reward_function.name"),
    ):
        assert any(f"`{old}`" in p and f"`{new}`" in p for p in problems), (old, problems)


@pytest.mark.parametrize(
    "line, engine",
    [
        (
            [
                "model_engine=megatron",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
                "critic.megatron.pipeline_model_parallel_size=2",
            ],
            "Megatron",
        ),
        (["model_engine=veomni", "actor_rollout_ref.actor.veomni.expert_parallel_size=2"], "VeOmni"),
        (["model_engine=torchtitan"], "TorchTitan"),
        (
            [
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
            ],
            "Megatron",
        ),
    ],
)
def test_other_engines_are_one_clear_error(files, line, engine):
    with pytest.raises(ConfigError) as info:
        load_config([*_common(files), *line])
    problems = info.value.problems
    assert len(problems) == 1, problems
    assert f"{engine} is not supported" in problems[0] and "FSDP2" in problems[0]


def test_v1_trainer_modes(files):
    cfg = load_config(
        [
            *_common(files),
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "trainer.n_gpus_per_node=2",
            "algorithm.rollout_correction.rollout_is=token",
        ],
        report=lambda line: None,
    )
    assert cfg.async_training.max_staleness == 1
    placement = cfg.source.trainer.placement  # as composed (the typed pools are plain mappings)
    assert placement.roles.rollout == "rollout"
    assert (placement.pools.rollout.nnodes, placement.pools.rollout.n_gpus_per_node) == (1, 1)
    with pytest.raises(ConfigError) as info:
        load_config([*_common(files), "trainer.v1.trainer_mode=colocate_async"])
    assert len(info.value.problems) == 1
    assert (
        info.value.problems[0].startswith("`trainer.v1.trainer_mode`=colocate_async")
        and "separate_async" in (info.value.problems[0])
    )


def test_refused_features_are_one_problem_each(files):
    keys = problem_keys(
        [
            *_common(files),
            "distillation.enabled=True",
            "distillation.distillation_loss.loss_mode=k3",
            "+distillation.teacher_models.gsm8k.model_path=/x",
            "actor_rollout_ref.actor.fsdp_config.qat.enable=True",
            "skip.rollout.enable=True",
            "reward.reward_manager.source=importlib",
        ]
    )
    assert keys == [
        "actor_rollout_ref.actor.fsdp_config.qat.enable",
        "distillation.enabled",
        "reward.reward_manager.source",
        "skip.rollout.enable",
    ], keys


def test_py_executable_program_must_exist(files, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no uv here
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                *_common(files),
                "ray_kwargs.ray_init.runtime_env.py_executable='uv -v run --frozen --extra vllm'",
            ]
        )
    (problem,) = info.value.problems
    assert "ray_kwargs.ray_init.runtime_env.py_executable" in problem and "`uv` is not on PATH" in problem
    # With a uv on PATH: verl's extras are not this project's, --frozen needs a lock; this project's extra loads.
    uv = tmp_path / "uv"
    uv.write_text("#!/bin/sh\nexit 0\n")
    uv.chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "p"\n[project.optional-dependencies]\ncpu = []\n'
    )
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                *_common(files),
                "ray_kwargs.ray_init.runtime_env.py_executable='uv -v run --frozen --extra vllm'",
            ]
        )
    assert len(info.value.problems) == 2
    assert "no extra vllm (its extras: cpu)" in info.value.problems[0] and "uv.lock" in info.value.problems[1]
    cfg = load_config([*_common(files), "ray_kwargs.ray_init.runtime_env.py_executable='uv run --extra cpu'"])
    assert cfg.source.trainer.ray_init.runtime_env.py_executable == "uv run --extra cpu"
    with pytest.raises(ConfigError) as info:
        load_config([*_common(files), "+ray_kwargs.ray_init.num_gpu=1"])
    assert "ray.init has no parameter 'num_gpu'" in info.value.problems[0]


def test_ray_init_kwargs_merge_over_fusedrl_s():
    from fusedrl.ray_config import ray_init_kwargs

    base = {"num_cpus": 2, "runtime_env": {"env_vars": {"A": "1"}}, "include_dashboard": False}
    got = ray_init_kwargs(
        base,
        {"num_gpus": 0, "runtime_env": {"py_executable": "uv run", "env_vars": {"B": 2}}, "namespace": None},
    )
    assert got == {
        "num_cpus": 2,
        "num_gpus": 0,
        "include_dashboard": False,
        "runtime_env": {"env_vars": {"A": "1", "B": "2"}, "py_executable": "uv run"},
    }
    assert ray_init_kwargs(base, {"runtime_env": {"py_executable": None}}) == base


def test_file_logger_writes_verl_s_format(tmp_path, monkeypatch):
    import json

    from fusedrl.tracking import Tracker

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    with Tracker(["file"], run_dir=str(tmp_path / "run"), project_name="p", experiment_name="e") as tracker:
        tracker.log({"actor/pg_loss": 0.5}, step=1)
        tracker.log({"actor/pg_loss": 0.25}, step=2)
    rows = [json.loads(x) for x in (tmp_path / "p" / "e.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "data": {"actor/pg_loss": 0.5}}, {"step": 2, "data": {"actor/pg_loss": 0.25}}]
