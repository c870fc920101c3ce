"""verl command lines load through main_ppo's loader unchanged; every verl key has a status.

The command lines below are written for this test in the shape of verl's example scripts (one per
algorithm family), with paths pointed at local tiny files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fusedrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("verl_lines")
    model = build_tiny_model(str(root / "model"))
    train, test = write_arithmetic_parquet(str(root / "data"), n_train=16, n_test=4, seed=0)
    return {"model": model, "train": train, "test": test}


def _common(f: dict[str, str]) -> list[str]:
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


FAMILIES: dict[str, list[str]] = {
    "ppo": [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "critic.optim.lr=1e-5",
        "critic.optim.lr_warmup_steps_ratio=0.05",
        "critic.model.use_remove_padding=True",
        "critic.model.enable_gradient_checkpointing=True",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.model.fsdp_config.param_offload=False",
        "critic.model.fsdp_config.optimizer_offload=False",
        "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
        "actor_rollout_ref.actor.strategy=fsdp",
        "critic.strategy=fsdp",
        "actor_rollout_ref.rollout.mode=sync",
    ],
    "grpo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.ppo_micro_batch_size=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=8",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
        "actor_rollout_ref.rollout.max_model_len=96",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.disable_log_stats=True",
    ],
    "dapo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "data.gen_batch_size=12",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=10.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "actor_rollout_ref.actor.optim.weight_decay=0.1",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
        "+reward_model.reward_kwargs.max_resp_len=16",
        "trainer.log_val_generations=10",
    ],
    "gspo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "reinforce_plus_plus": [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=mse",
    ],
    "rloo": [
        "algorithm.adv_estimator=rloo",
        "actor_rollout_ref.rollout.n=4",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_penalty=kl",
        "algorithm.kl_ctrl.kl_coef=0.001",
    ],
    "remax": [
        "algorithm.adv_estimator=remax",
        "actor_rollout_ref.rollout.n=4",
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.actor.use_kl_loss=False",
    ],
    "reward_model_ppo": [
        "algorithm.adv_estimator=gae",
        "reward_model.enable=True",
        "MODEL=reward_model.model.path",
        "reward_model.micro_batch_size_per_gpu=4",
        "reward_model.model.use_remove_padding=False",
        "reward_model.model.fsdp_config.param_offload=True",
        "reward_model.use_reward_loop=False",
        "critic.ppo_micro_batch_size_per_gpu=2",
    ],
    "lora": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.model.lora_rank=32",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.model.use_shm=True",
        "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True",
    ],
    "gmpo_gpg_cispo": [
        "algorithm.adv_estimator=gpg",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.4",
        "actor_rollout_ref.actor.clip_ratio_high=0.4",
    ],
    "sapo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        "actor_rollout_ref.actor.tau_pos=1.0",
        "actor_rollout_ref.actor.tau_neg=1.05",
    ],
    "rollout_correction": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.rollout_rs=geometric",
        "algorithm.rollout_correction.rollout_rs_threshold=1.01",
        "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
    ],
    "grpo_n1": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"],
}


def _same(got, text: str) -> bool:
    try:
        return float(got) == float(text)
    except (TypeError, ValueError):
        return str(got).lower() == text.lower().strip("'")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verl_command_line_loads(files, family):
    from fusedrl.trainer import main_ppo

    extra = [
        f"{ov.split('=', 1)[1]}={files['model']}" if ov.startswith("MODEL=") else ov
        for ov in FAMILIES[family]
    ]
    lines: list[str] = []
    cfg = load_config(["--config-name", "ppo_trainer", *_common(files), *extra], report=lines.append)
    assert main_ppo.load_config is load_config  # the entry point's own loader
    # Every set key landed (the ones fusedrl has) and nothing was rejected.
    for ov in extra + _common(files):
        key, value = ov.lstrip("+").split("=", 1)
        if key.startswith(("reward_model.reward_kwargs.", "trainer.logger", "data.truncation")):
            continue
        from omegaconf import OmegaConf

        got = OmegaConf.select(cfg, key, default="<absent>")
        if got != "<absent>":
            assert _same(got, value), (key, got, value)
    assert len(lines) <= 1  # at most one console line names the ignored keys
    if family == "lora":
        # LoRA is implemented: its keys landed (checked above) and only the engine-side ones are named
        assert cfg.actor_rollout_ref.model.lora_rank == 32
        assert "lora_rank" not in lines[0] and "layered_summon" in lines[0] and "load_format" in lines[0]
    if family == "dapo":
        ob = cfg.reward_model.overlong_buffer
        assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4, 1.0)
        assert "overlong_buffer_cfg.log" in lines[0] and "max_resp_len" not in lines[0]
        assert "max_resp_len" not in cfg.reward_model.reward_kwargs and ob.max_resp_len == 16  # DAPO's L
    if family == "grpo":  # global micro-batches / 2 workers
        arr = cfg.actor_rollout_ref
        assert arr.actor.ppo_micro_batch_size_per_gpu == 2
        assert arr.rollout.log_prob_micro_batch_size_per_gpu == 4 == arr.ref.log_prob_micro_batch_size_per_gpu
    if family == "ppo":
        assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2  # implemented: not ignored
        assert "actor.ulysses_sequence_parallel_size" not in lines[0] and "fsdp_size" in lines[0]


def test_unread_plus_key_is_reported_and_reward_kwargs_are_not(files):
    lines: list[str] = []
    cfg = load_config(
        [
            *_common(files),
            "+trainer.my_note=hello",
            "+reward_model.reward_kwargs.format_score=0.1",
        ],
        report=lines.append,
    )
    assert cfg.trainer.my_note == "hello" and cfg.reward_model.reward_kwargs.format_score == 0.1
    assert len(lines) == 1 and "trainer.my_note (added with +, but nothing in fusedrl reads it)" in lines[0]
    assert "format_score" not in lines[0]


def test_unsupported_backends_and_configs_are_one_clear_error_each(files):
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                *_common(files),
                "--config-name=ppo_megatron_trainer",
                "actor_rollout_ref.actor.strategy=megatron",
                "actor_rollout_ref.rollout.name=sglang",
                "actor_rollout_ref.actor.ppo_micro_batch_size=3",
            ]
        )
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert any("Megatron" in p and "--config-name" in p for p in problems)
    assert any(p.startswith("`actor_rollout_ref.actor.strategy`=megatron") for p in problems)
    assert any(p.startswith("`actor_rollout_ref.rollout.name`=sglang") and "vllm" in p for p in problems)
    assert any(p.startswith("`actor_rollout_ref.actor.ppo_micro_batch_size`=3") for p in problems)


def test_new_keys_bad_values_are_reported_together(files):
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                *_common(files),
                "algorithm.rollout_correction.rollout_rs=seq_max_k1",  # not a verl option either
                "algorithm.rollout_correction.loss_type=reinforce",  # without bypass_mode
                "actor_rollout_ref.actor.optim.lr_scheduler_type=linear",
                "critic.optim.min_lr_ratio=2.0",
                "actor_rollout_ref.rollout.mode=eager",
                "data.truncation=cut",
                "trainer.critic_warmup=-1",
                "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
            ]
        )
    keys = sorted(p.split("`")[1] for p in info.value.problems)
    assert keys == [
        "actor_rollout_ref.actor.checkpoint.load_contents",
        "actor_rollout_ref.actor.checkpoint.save_contents",
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        "actor_rollout_ref.rollout.mode",
        "algorithm.rollout_correction.loss_type",
        "algorithm.rollout_correction.rollout_rs",
        "algorithm.rollout_correction.rollout_rs_threshold",
        "critic.optim.min_lr_ratio",
        "data.truncation",
        "trainer.critic_warmup",
    ], info.value.problems


def test_every_verl_key_has_a_status_and_the_doc_is_current():
    spec = importlib.util.spec_from_file_location("gen_verl", ROOT / "scripts" / "gen_verl_compat_docs.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rows = gen.statuses()  # raises naming any verl key without a status
    from fusedrl.verl_compat import verl_keys

    assert len(rows) == len(verl_keys()) > 400
    assert (ROOT / "docs" / "verl_compat.md").read_text(encoding="utf-8") == gen.render(), (
        "docs/verl_compat.md is out of date: run `python scripts/gen_verl_compat_docs.py`"
    )


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
    cfg = load_config(_main_line(files, reward_file, family), report=lines.append)  # no ConfigError
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
    with pytest.raises(ConfigError) as info:
        load_config(
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
    problems = info.value.problems
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
    assert cfg.trainer.placement.roles.rollout == "rollout"
    assert (
        cfg.trainer.placement.pools.rollout.nnodes,
        cfg.trainer.placement.pools.rollout.n_gpus_per_node,
    ) == (1, 1)
    with pytest.raises(ConfigError) as info:
        load_config([*_common(files), "trainer.v1.trainer_mode=colocate_async"])
    assert len(info.value.problems) == 1
    assert (
        info.value.problems[0].startswith("`trainer.v1.trainer_mode`=colocate_async")
        and "separate_async" in (info.value.problems[0])
    )


def test_refused_features_are_one_problem_each(files):
    with pytest.raises(ConfigError) as info:
        load_config(
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
    keys = sorted(p.split("`")[1] for p in info.value.problems)
    assert keys == [
        "actor_rollout_ref.actor.fsdp_config.qat.enable",
        "distillation.enabled",
        "reward.reward_manager.source",
        "skip.rollout.enable",
    ], info.value.problems


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
    assert cfg.trainer.ray_init.runtime_env.py_executable == "uv run --extra cpu"
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
