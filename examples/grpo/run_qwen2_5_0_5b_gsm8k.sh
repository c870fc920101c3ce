#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct: the GPU recipe.
# Its CPU twin (the same algorithm settings on a tiny model, 2 CPU cores) is run_tiny_cpu.sh here.
#
# Hardware: 1 GPU with 80 GB (H100 / A100 80GB), or 8 GPUs on one node with NGPUS=8 (same global batch,
#   split 8 ways). Every GPU holds one fused worker: FSDP2 actor + reference + vLLM.
# Time: ~3 h for 2 epochs on 1 H100 (estimate, not measured).
# Expected: the greedy validation score val/test_score/openai/gsm8k (logged at step 0, then every 10
#   steps) rises over the first epoch from the instruct model's own accuracy; published RL runs of
#   this model end around 0.5-0.6. This recipe has not yet been run end to end with fusedrl.
# Before: pip install datasets wandb. The data is built and the model downloaded on first use (unless
#   MODEL_PATH is a local folder). wandb logs offline under the checkpoint folder unless WANDB_MODE=online
#   (or `wandb sync` it later); trainer.logger='[console,jsonl]' drops it.
# Usage: bash examples/grpo/run_qwen2_5_0_5b_gsm8k.sh [key=value overrides]
#   env: MODEL_PATH (default Qwen/Qwen2.5-0.5B-Instruct), DATA_DIR (default ~/data/gsm8k; built by
#   examples/data_preprocess/gsm8k.py when missing), NGPUS (default 1), PYTHON.
#   `--print-overrides` prints the key=value list one per line and exits (nothing is downloaded or run).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
NGPUS="${NGPUS:-1}"
PRINT_ONLY=0
if [ "${1:-}" = "--print-overrides" ]; then PRINT_ONLY=1; shift; fi

if [ "$PRINT_ONLY" = 0 ]; then
    if [ ! -f "$DATA_DIR/train.parquet" ]; then
        "$PY" "$ROOT/examples/data_preprocess/gsm8k.py" --local_dir "$DATA_DIR"
    fi
    if [ ! -d "$MODEL_PATH" ]; then  # a hub id: fetch it once (huggingface_hub caches it), use the folder
        MODEL_PATH="$("$PY" -c 'import sys, huggingface_hub as h; print(h.snapshot_download(sys.argv[1]))' \
            "$MODEL_PATH")"
    fi
fi

# data: 64 prompts a step; GSM8K prompts with the chat template fit in 512 tokens
DATA=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=64
    data.max_prompt_length=512
    data.max_response_length=512
    data.truncation=filter
)
# model and actor: fp32 master weights, bf16 compute; 4 optimizer steps per RL step
MODEL=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.weight_decay=0.01
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.entropy_coeff=0.0
    actor_rollout_ref.actor.fsdp_config.model_dtype=float32
    actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16
    actor_rollout_ref.ref.fsdp_config.param_dtype=bfloat16
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
)
# rollout: in-process vLLM in bf16, 5 samples per prompt; it sleeps (frees its KV cache) while training
ROLLOUT=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.dtype=bfloat16
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.rollout.free_cache_engine=true
)

# algorithm: group-relative advantages (5 samples per prompt, normalised by the group's std),
# k3 KL loss to the frozen reference
ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=true
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.loss_agg_mode=token-mean
)

# trainer: 2 epochs over the 7473 training problems, greedy validation on the 1319 test problems
TRAINER=(
    trainer.nnodes=1
    trainer.n_gpus_per_node="$NGPUS"
    trainer.total_epochs=2
    trainer.val_before_train=true
    trainer.test_freq=10
    trainer.save_freq=50
    trainer.max_actor_ckpt_to_keep=2
    trainer.logger='[console,wandb]'
    trainer.project_name=fusedrl_gsm8k
    trainer.experiment_name=qwen2_5_0_5b_grpo
)
OVERRIDES=("${DATA[@]}" "${MODEL[@]}" "${ROLLOUT[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@")
if [ "$PRINT_ONLY" = 1 ]; then printf '%s\n' "${OVERRIDES[@]}"; exit 0; fi
"$PY" -m fusedrl.trainer.main_ppo "${OVERRIDES[@]}"
