"""verl command lines load through main_ppo's loader unchanged; every verl key has a status.

The command lines below are written for this test in the shape of verl's example scripts (one per
algorithm family), with paths pointed at local tiny files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from verl_lines import common_overrides as _common
from verl_lines import problem_keys, problems_of

from fusedrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


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

        got = OmegaConf.select(cfg.source, key, default="<absent>")
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
    assert cfg.source.trainer.my_note == "hello" and cfg.reward_model.reward_kwargs["format_score"] == 0.1
    assert len(lines) == 1 and "trainer.my_note (added with +, but nothing in fusedrl reads it)" in lines[0]
    assert "format_score" not in lines[0]


def test_unsupported_backends_and_configs_are_one_clear_error_each(files):
    problems = problems_of(
        [
            *_common(files),
            "--config-name=ppo_megatron_trainer",
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.actor.ppo_micro_batch_size=3",
        ]
    )
    assert len(problems) == 4, problems
    assert any("Megatron" in p and "--config-name" in p for p in problems)
    assert any(p.startswith("`actor_rollout_ref.actor.strategy`=megatron") for p in problems)
    assert any(p.startswith("`actor_rollout_ref.rollout.name`=sglang") and "vllm" in p for p in problems)
    assert any(p.startswith("`actor_rollout_ref.actor.ppo_micro_batch_size`=3") for p in problems)


def test_new_keys_bad_values_are_reported_together(files):
    keys = problem_keys(
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
    ], keys


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


def test_global_micro_batches_split_over_each_roles_data_parallel_ranks(files):
    """verl divides a global micro-batch by the role's data-parallel ranks: its pool's workers over its
    Ulysses size. Here the actor (and so the old log-probs and the reference) has a pool of 8 with sp 2 (4 data-
    parallel ranks), the critic the default pool of 2 workers with sp 2 (1 rank); trainer.n_gpus_per_node x
    nnodes (2) is neither. The per-rank sizes are derived into the typed configs; the composed config keeps
    what was written."""
    from fusedrl.micro_batches import data_parallel_size
    from fusedrl.role_config import run_config

    placed = [
        *_common(files),
        "trainer.placement.pools={train: {nnodes: 2, n_gpus_per_node: 4}}",
        "trainer.placement.roles={actor: train, ref: train, rollout: train}",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "critic.ulysses_sequence_parallel_size=2",
    ]
    globals_ = [
        "actor_rollout_ref.actor.ppo_micro_batch_size=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=12",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=4",
        "critic.ppo_micro_batch_size=6",
        "critic.forward_micro_batch_size=4",
    ]
    cfg = load_config([*placed, *globals_], validate_config=False)
    written = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    assert (
        data_parallel_size(cfg.source.trainer, "actor", 2) == 4
        and data_parallel_size(cfg.source.trainer, "critic", 2) == 1
    )
    run = run_config(cfg)
    assert run.actor.ppo_micro_batch_size_per_gpu == 2  # 8 / (8 workers / sp 2)
    assert run.rollout.log_prob_micro_batch_size_per_gpu == 3  # 12 / 4
    assert run.ref.log_prob_micro_batch_size_per_gpu == 1  # 4 / 4: the reference on the actor's pool and sp
    assert run.critic.ppo_micro_batch_size_per_gpu == 6  # 6 / (the default pool's 2 workers / sp 2)
    assert run.critic.forward_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == written  # not rewritten
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size == 8
    with pytest.raises(ConfigError) as err:
        load_config([*placed, "actor_rollout_ref.actor.ppo_micro_batch_size=6"], validate_config=False)
    (problem,) = err.value.problems
    assert problem.startswith("`actor_rollout_ref.actor.ppo_micro_batch_size`=6")
    assert "actor's 4 data-parallel ranks" in problem
