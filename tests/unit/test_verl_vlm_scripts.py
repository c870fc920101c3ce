"""verl main's vision-language example scripts (FSDP + vLLM) load with `fusedrl.config.load_config`.

Each line below is what the script passes to ``verl.trainer.main_ppo`` with its defaults (GPU, vLLM, no uv),
as the script at verl main 1dda039 (2026-08-22) renders it, in its order; only the data files, the model
folder and the run folder are replaced by local ones: the model is the tiny random Qwen2.5-VL for every script
(Qwen3-VL, GLM-4.1V and MiniCPM-o are not built here). Keys with no effect are named on one line, never
unknown; a value fusedrl cannot run is one problem naming the key.

Left out: the Megatron scripts (``run_qwen2_5_vl_7b_megatron.sh``, ``run_qwen3_vl_8b_megatron.sh``,
``run_qwen3_vl_30b_a3b_megatron.sh``, ``run_qwen3_vl_235b_a22b_megatron.sh``), the VeOmni ones
(``run_qwen3_vl_30b_moe_veomni.sh``) and ``profile/run_qwen2_5_vl_7b_torch_memory.sh`` (sglang rollout).
"""

from __future__ import annotations

import pytest
from verl_lines import problem_keys

from fusedrl.config import load_config

_VERL = [  # shared by the geo3k GRPO scripts
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.image_key=images",
    "data.train_batch_size=512",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
]
_DYNAMIC = [
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576",
]
_KL = [
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
]
_LOG_PROB_DYNAMIC = [
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
]
_TRAINER = [
    'trainer.logger=["console","wandb"]',
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
_RAY = ["ray_kwargs.ray_init.runtime_env.py_executable=null"]
_NO_OFFLOAD = [
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
]

SCRIPTS: dict[str, list[str]] = {
    "grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh": [
        *_VERL,
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        *_DYNAMIC,
        *_KL,
        *_NO_OFFLOAD,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        *_LOG_PROB_DYNAMIC,
        "trainer.balance_batch=True",
        *_TRAINER,
        "trainer.save_freq=20",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.rollout.multi_stage_wake_up=True",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        *_RAY,
    ],
    "grpo_trainer/run_qwen3_vl_8b_fsdp.sh": [
        *_VERL,
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        *_DYNAMIC,
        *_KL,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.n=5",
        *_LOG_PROB_DYNAMIC,
        "trainer.balance_batch=True",
        *_TRAINER,
        "trainer.save_freq=20",
        "actor_rollout_ref.model.use_fused_kernels=True",
        *_NO_OFFLOAD,
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        *_RAY,
    ],
    "grpo_trainer/run_qwen3_vl_30b_a3b_fsdp.sh": [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.6_1.6",
        "data.train_batch_size=512",
        "data.max_prompt_length=1024",
        "data.max_response_length=2048",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "data.image_key=images",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10",
        *_KL,
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=8",
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=True",
        "actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
        *_NO_OFFLOAD,
        "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.max_num_batched_tokens=20000",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.enable_chunked_prefill=True",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "actor_rollout_ref.ref.fsdp_config.reshard_after_forward=True",
        "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True",
        "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
        "trainer.critic_warmup=0",
        'trainer.logger=["console", "wandb"]',
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.resume_mode=auto",
        "trainer.val_before_train=True",
        "trainer.save_freq=5",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
        *_RAY,
    ],
    "grpo_trainer/run_glm4_1v_9b_fsdp.sh": [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=512",
        "data.max_prompt_length=1024",
        "data.max_response_length=2048",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "data.image_key=images",
        "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10",
        *_KL,
        *_NO_OFFLOAD,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "trainer.critic_warmup=0",
        *_TRAINER,
        "trainer.save_freq=20",
        *_RAY,
    ],
    "grpo_trainer/run_minicpm_o_2_6_fsdp.sh": [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=128",
        "data.max_prompt_length=1024",
        "data.max_response_length=2048",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.image_key=images",
        "data.trust_remote_code=True",
        "data.custom_cls.path=recipe/minicpmo/rl_dataset.py",
        "data.custom_cls.name=RLHFDataset",
        "algorithm.kl_ctrl.kl_coef=0.001",
        "actor_rollout_ref.model.trust_remote_code=True",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        *_NO_OFFLOAD,
        "actor_rollout_ref.actor.fsdp_config.use_orig_params=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "trainer.critic_warmup=0",
        *_TRAINER,
        "trainer.save_freq=-1",
        *_RAY,
    ],
    "tuning/lora/run_qwen2_5_vl_7b_fsdp.sh": [
        *_VERL,
        "actor_rollout_ref.model.lora_rank=64",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.model.exclude_modules=.*visual.*",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        *_DYNAMIC,
        *_KL,
        *_NO_OFFLOAD,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.n=5",
        *_LOG_PROB_DYNAMIC,
        "trainer.balance_batch=True",
        *_TRAINER,
        "trainer.save_freq=20",
        *_RAY,
    ],
}

# On-policy distillation from a VL teacher: a separate feature, refused as one problem.
DISTILLATION = "on_policy_distillation_trainer/run_qwen3_vl_8b_fsdp.sh"
DISTILLATION_LINE = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_batch_size=128",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "data.image_key=images",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    *_DYNAMIC,
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.rollout.n=1",
    "actor_rollout_ref.rollout.max_model_len=3073",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "trainer.balance_batch=True",
    *_TRAINER,
    "trainer.val_before_train=False",
    "trainer.save_freq=200",
    "distillation.enabled=True",
    "distillation.n_gpus_per_node=4",
    "distillation.nnodes=1",
    "distillation.teacher_models.teacher_model.model_path=TEACHER",
    "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
    "distillation.teacher_models.teacher_model.inference.name=vllm",
    "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4",
    "distillation.teacher_models.teacher_model.inference.max_model_len=3073",
    "distillation.distillation_loss.loss_mode=k1",
    "distillation.distillation_loss.topk=64",
    "distillation.distillation_loss.use_task_rewards=False",
    "distillation.distillation_loss.use_policy_gradient=True",
    "distillation.distillation_loss.loss_max_clamp=10.0",
    "distillation.distillation_loss.log_prob_min_clamp=-10.0",
    *_RAY,
]


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory) -> dict[str, str]:
    """The tiny random Qwen2.5-VL and shape-picture parquet files in verl's multimodal schema."""
    from vlm_support import write_shapes_parquet

    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("verl_vlm_lines")
    return {
        "model": build_tiny_vlm(str(root / "model"), seed=0),
        "train": write_shapes_parquet(root / "train.parquet", rows=8),
        "test": write_shapes_parquet(root / "test.parquet", rows=4),
        "run": str(root / "run"),
    }


def _local(files: dict[str, str], line: list[str]) -> list[str]:
    return [
        f"data.train_files={files['train']}",
        f"data.val_files={files['test']}",
        f"actor_rollout_ref.model.path={files['model']}",
        *(ov.replace("TEACHER", files["model"]) for ov in line),
        "trainer.project_name=verl_grpo_geo3k",
        "trainer.experiment_name=local",
        f"trainer.default_local_dir={files['run']}",
    ]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_verl_vision_language_script_loads(vlm_files, script):
    said: list[str] = []
    cfg = load_config(_local(vlm_files, SCRIPTS[script]), report=said.append)  # no ConfigError
    text = " ".join(said)
    assert "unknown" not in text, text
    assert cfg.data.image_key == "images"
    assert cfg.actor_rollout_ref.model.path == vlm_files["model"]
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    if "use_fused_kernels=True" in " ".join(SCRIPTS[script]):
        assert "use_fused_kernels" in text  # named as having no effect
    if script.startswith("tuning/lora"):  # LoRA on the decoder, the vision tower left out (verl's meaning)
        model = cfg.actor_rollout_ref.model
        assert (model.lora_rank, model.lora_alpha) == (64, 32)
        assert model.exclude_modules == ".*visual.*"
    if "minicpm" in script:  # verl's remote-code dataset class is named, not silently used or refused
        assert "data.custom_cls" in text and "trust_remote_code" in text
    if "30b_a3b" in script:
        rc = cfg.algorithm.rollout_correction
        assert (rc.rollout_is, rc.rollout_rs) == ("sequence", "token_k1")


def test_verl_vision_language_distillation_script_is_one_refusal(vlm_files):
    assert "distillation.enabled" in problem_keys(_local(vlm_files, DISTILLATION_LINE))
