# Shared body of the examples/<algorithm>/run_qwen2_5_0_5b_gsm8k.sh GPU recipes: sourced by each recipe
# after it sets RECIPE (the algorithm's name) and, where it differs, N_SAMPLES / TRAIN_BATCH / MINI_BATCH /
# RESPONSE_LEN; the recipe then defines its ALGORITHM array and calls `run_recipe "$@"`.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
N_SAMPLES="${N_SAMPLES:-5}"
TRAIN_BATCH="${TRAIN_BATCH:-64}"
MINI_BATCH="${MINI_BATCH:-16}"
RESPONSE_LEN="${RESPONSE_LEN:-512}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
NGPUS="${NGPUS:-1}"
PRINT_ONLY=0
if [ "${1:-}" = "--print-overrides" ]; then PRINT_ONLY=1; shift; fi

# shellcheck source=examples/common/gpu_inputs.sh
source "$ROOT/examples/common/gpu_inputs.sh"
prepare_gpu_inputs "$ROOT/examples/data_preprocess/gsm8k.py"

# data: TRAIN_BATCH prompts a step; GSM8K prompts with the chat template fit in 512 tokens
DATA=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size="$TRAIN_BATCH"
    data.max_prompt_length=512
    data.max_response_length="$RESPONSE_LEN"
    data.filter_overlong_prompts=true
    data.truncation=error
)
# model and actor: fp32 master weights, bf16 compute; 4 optimizer steps per RL step; training state in host
# memory while vLLM generates
MODEL=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.actor.use_dynamic_bsz=true
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.weight_decay=0.01
    actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH"
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.entropy_coeff=0.0
    actor_rollout_ref.actor.fsdp_config.model_dtype=float32
    actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16
    actor_rollout_ref.ref.fsdp_config.param_dtype=bfloat16
    actor_rollout_ref.actor.fsdp_config.param_offload=true
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
    actor_rollout_ref.ref.fsdp_config.param_offload=true
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
)
# rollout: in-process vLLM in bf16, N_SAMPLES samples per prompt; while training it sleeps at level 2 (frees
# KV cache and weights: the new weights are streamed in before the next rollout anyway)
ROLLOUT=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n="$N_SAMPLES"
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.dtype=bfloat16
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.rollout.free_cache_engine=true
    actor_rollout_ref.rollout.sleep_level=2
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
    trainer.experiment_name="qwen2_5_0_5b_$RECIPE"
)

run_recipe() {
    local overrides=("${DATA[@]}" "${MODEL[@]}" "${ROLLOUT[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@")
    if [ "$PRINT_ONLY" = 1 ]; then printf '%s\n' "${overrides[@]}"; exit 0; fi
    "$PY" -m fusedrl.trainer.main_ppo "${overrides[@]}"
}
