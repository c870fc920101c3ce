#!/usr/bin/env bash
# GRPO on Geometry3K (diagrams + questions) with Qwen2.5-VL-3B-Instruct: the vision-language GPU recipe.
# Its CPU twin (the same image path on a tiny random Qwen2.5-VL, 2 CPU cores) is shapes_grpo.py here.
#
# Hardware: one node of 8 GPUs with 80 GB (H100 / A100 80GB). Every GPU holds one fused worker: the FSDP2
#   actor and reference (bf16 compute, fp32 master weights; the reference in host memory) and an in-process
#   vLLM engine (bf16, one GPU per engine). On one GPU (NGPUS=1) also offload the actor
#   (actor_rollout_ref.actor.fsdp_config.param_offload=true optimizer_offload=true): the 3.8B parameters'
#   fp32 weights, gradients and Adam moments are ~60 GB.
# Time: not measured. This recipe has not been run end to end with fusedrl (no GPU was available); its
#   command line loads validated on the tiny model (tests/unit/test_vlm_recipe.py), and verl's own 7B geo3k
#   line runs on 2 CPU workers (docs/multimodal.md).
# Expected: the greedy validation score val/test_score/hiyouga/geometry3k (step 0, then every 5 steps) rises
#   from the instruct model's own accuracy over the first epochs (not yet observed with fusedrl).
# Before: pip install datasets wandb. The data is built (geo3k_data.py) and the model downloaded on first use
#   (unless MODEL_PATH is a local folder). trainer.logger='[console,jsonl]' drops wandb.
# Usage: bash examples/vision_language/run_qwen2_5_vl_3b_geo3k.sh [key=value overrides]
#   env: MODEL_PATH (default Qwen/Qwen2.5-VL-3B-Instruct), DATA_DIR (default ~/data/geo3k), NGPUS (default 8),
#   EPOCHS (default 15), PYTHON.
#   `--print-overrides` prints the key=value list one per line and exits (nothing is downloaded or run).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-VL-3B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/geo3k}"
NGPUS="${NGPUS:-8}"
EPOCHS="${EPOCHS:-15}"
PRINT_ONLY=0
if [ "${1:-}" = "--print-overrides" ]; then PRINT_ONLY=1; shift; fi

# shellcheck source=examples/common/gpu_inputs.sh
source "$ROOT/examples/common/gpu_inputs.sh"
prepare_gpu_inputs "$HERE/geo3k_data.py"

# data: one diagram per problem (the `images` column); diagram tokens count towards the prompt length
DATA=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.image_key=images
    data.train_batch_size=512
    data.max_prompt_length=1024
    data.max_response_length=2048
    data.filter_overlong_prompts=true
    data.truncation=error
)
# model and actor: the vision tower trains too (verl's default); packed sequences, token-budget micro-batches
# (a prompt + response is at most 3072 tokens), gradient checkpointing; fp32 master weights, bf16 compute
MODEL=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.actor.freeze_vision_tower=false
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.weight_decay=0.01
    actor_rollout_ref.actor.ppo_mini_batch_size=128
    actor_rollout_ref.actor.use_dynamic_bsz=true
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.entropy_coeff=0.0
    actor_rollout_ref.actor.fsdp_config.model_dtype=float32
    actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16
    actor_rollout_ref.actor.fsdp_config.param_offload=false
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=false
    actor_rollout_ref.ref.fsdp_config.param_dtype=bfloat16
    actor_rollout_ref.ref.fsdp_config.param_offload=true
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384
)
# algorithm: GRPO, 5 samples per diagram, k3 KL loss to the frozen reference (verl's geo3k settings)
ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.01
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    custom_reward_function.path="$HERE/geo3k_reward.py"
    custom_reward_function.name=compute_score
)
# rollout: in-process vLLM in bf16 on each GPU; it frees its cache while the actor trains
ROLLOUT=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.dtype=bfloat16
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384
    actor_rollout_ref.rollout.free_cache_engine=true
)
# trainer: EPOCHS passes over the 2101 training problems, greedy validation on the 601 test problems
TRAINER=(
    trainer.balance_batch=true
    trainer.nnodes=1
    trainer.n_gpus_per_node="$NGPUS"
    trainer.total_epochs="$EPOCHS"
    trainer.val_before_train=true
    trainer.test_freq=5
    trainer.save_freq=20
    trainer.max_actor_ckpt_to_keep=2
    trainer.logger='[console,wandb]'
    trainer.project_name=fusedrl_geo3k
    trainer.experiment_name=qwen2_5_vl_3b_grpo
)

overrides=("${DATA[@]}" "${MODEL[@]}" "${ALGORITHM[@]}" "${ROLLOUT[@]}" "${TRAINER[@]}" "$@")
if [ "$PRINT_ONLY" = 1 ]; then printf '%s\n' "${overrides[@]}"; exit 0; fi
"$PY" -m fusedrl.trainer.main_ppo "${overrides[@]}"
