"""verl main's mixture-of-experts FSDP example scripts load with `fusedrl.config.load_config` (issue 43: "verl's
MoE FSDP scripts' keys load").

Each line is what the script passes to ``verl.trainer.main_ppo`` with its defaults (GPU, vLLM, no uv), as the
script at verl main 1dda039 (2026-08-22) renders it; only the data files, the model folder and the run folder
are local (the tiny random Qwen3-MoE, `fusedrl.utils.tiny_moe`, for every script). Keys with no effect are named
on one line, never unknown; the expert-parallel size of the FSDP-turbo script is read by the actor and the
reference (`fusedrl.expert_parallel_checks`).

Left out: the Megatron scripts (``run_qwen3_30b_a3b_megatron.sh``, ``run_qwen3_5_35b_megatron*.sh``,
``router_replay/run_qwen3_30b_a3b_megatron.sh`` ...), the VeOmni ones and ``run_gpt_oss_20b_fsdp.sh`` (its
rollout is SGLang, which fusedrl refuses with a named problem like any other engine it does not run).
"""

from __future__ import annotations

import pytest

from fusedrl.config import load_config

_RAY = ["ray_kwargs.ray_init.runtime_env.py_executable=null"]

# examples/grpo_trainer/run_qwen3_30b_a3b_fsdp.sh (GSM8K + MATH, 8 GPUs)
QWEN3_30B_A3B = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_batch_size=512",
    "data.max_prompt_length=2048",
    "data.max_response_length=4096",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.balance_batch=True",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_gsm8k_math",
    "trainer.experiment_name=qwen3_30b_a3b_vllm_fsdp",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
    *_RAY,
]

# examples/grpo_trainer/run_qwen3_5_35b_fsdp_turbo.sh on GPUs (SP_SIZE=1, EP_SIZE=8, fsdp_size 8), without its
# geo3k images (the tiny MoE is a text model): FSDP-turbo's plans are verl's own engine settings.
_TURBO = "actor_rollout_ref.{}.fsdp_config.turbo_config"
_PLANS = [
    "distributed.fully_shard_parallel_size=8",
    "distributed.expert_parallel_size=8",
    "distributed.ulysses_parallel_size=1",
]
_PLUS_PLANS = [
    "distributed.fsdp_plan.apply_modules={model.language_model.layers.\\{*\\}:{},lm_head:{}}",
    "distributed.fsdp_plan.hook_modules=['model.language_model.layers.{*}']",
    "distributed.ep_plan.apply_modules=['model.language_model.layers.{*}.mlp.experts']",
    "distributed.ep_plan.dispatcher=eager",
    "memory.recompute=True",
    "memory.recompute_plan=['model.language_model.layers.{*}']",
]


def _turbo(role: str) -> list[str]:
    base = _TURBO.format(role)
    return [f"{base}.{p}" for p in _PLANS] + [f"+{base}.{p}" for p in _PLUS_PLANS]


QWEN3_5_35B_TURBO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_batch_size=16",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "data.shuffle=False",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.optimizer=AdamW",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.use_dynamic_bsz=False",
    "actor_rollout_ref.actor.strategy=fsdp_turbo",
    *_turbo("actor"),
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=True",
    "actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=True",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.actor.fsdp_config.offload_policy=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.strategy=fsdp_turbo",
    *_turbo("ref"),
    "actor_rollout_ref.ref.fsdp_config.reshard_after_forward=True",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
    "actor_rollout_ref.ref.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.offload_policy=True",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.ignore_eos=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
    "actor_rollout_ref.rollout.free_cache_engine=True",
    "actor_rollout_ref.rollout.enforce_eager=False",
    "actor_rollout_ref.rollout.enable_prefix_caching=False",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=6144",
    '+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode="FULL_DECODE_ONLY"',
    '+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes="[4,8,12,16]"',
    "trainer.critic_warmup=0",
    "trainer.logger=['console']",
    "trainer.project_name=GRPO-Qwen3_5",
    "trainer.experiment_name=GRPO-Qwen3_5-35B",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.balance_batch=False",
    "trainer.val_before_train=False",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "trainer.total_epochs=15",
]

SCRIPTS = {
    "grpo_trainer/run_qwen3_30b_a3b_fsdp.sh": QWEN3_30B_A3B,
    "grpo_trainer/run_qwen3_5_35b_fsdp_turbo.sh": QWEN3_5_35B_TURBO,
}


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    root = tmp_path_factory.mktemp("verl_moe_lines")
    train, test = write_arithmetic_parquet(str(root / "data"), n_train=32, n_test=4, seed=0)
    return {
        "model": build_tiny_moe_model(root / "model"),
        "train": train,
        "test": test,
        "run": str(root / "run"),
    }


def _local(files: dict[str, str], line: list[str]) -> list[str]:
    return [
        f"data.train_files={files['train']}",
        f"data.val_files={files['test']}",
        f"actor_rollout_ref.model.path={files['model']}",
        *line,
        f"trainer.default_local_dir={files['run']}",
    ]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_verl_moe_script_loads(moe_files, script):
    said: list[str] = []
    cfg = load_config(_local(moe_files, SCRIPTS[script]), report=said.append)
    arr = cfg.actor_rollout_ref
    assert arr.actor.use_kl_loss and arr.rollout.name == "vllm" and cfg.trainer.n_gpus_per_node == 8
    if script.endswith("turbo.sh"):
        # The expert-parallel sizes reach both roles; the turbo-only plans are named as having no effect.
        assert arr.actor.fsdp_config.turbo_config.distributed.expert_parallel_size == 8
        assert arr.ref.fsdp_config.turbo_config.distributed.expert_parallel_size == 8
        assert "fsdp_plan" in " ".join(said)
    else:  # every key of this script has its verl effect here: nothing is named
        assert said == [] and arr.actor.use_dynamic_bsz and arr.rollout.tensor_model_parallel_size == 4
