#!/usr/bin/env bash
# DAPO on GSM8K with Qwen2.5-0.5B-Instruct: the GPU recipe.
# Its CPU twin (the same algorithm settings on a tiny model, 2 CPU cores) is run_tiny_cpu.sh here.
#
# Hardware: 1 GPU with 80 GB (H100 / A100 80GB), or 8 GPUs on one node with NGPUS=8 (same global batch,
#   split 8 ways). Every GPU holds one fused worker: FSDP2 actor + vLLM.
# Time: ~6-8 h for 2 epochs on 1 H100, dynamic sampling generates extra batches (estimate, not measured).
# Expected: the greedy validation score val/test_score/openai/gsm8k (logged at step 0, then every 10
#   steps) rises over the first epoch from the instruct model's own accuracy; published RL runs of
#   this model end around 0.5-0.6. This recipe has not yet been run end to end with fusedrl.
# Before: pip install datasets wandb. The data is built and the model downloaded on first use (unless
#   MODEL_PATH is a local folder). wandb logs offline under the checkpoint folder unless WANDB_MODE=online
#   (or `wandb sync` it later); trainer.logger='[console,jsonl]' drops it.
# Usage: bash examples/dapo/run_qwen2_5_0_5b_gsm8k.sh [key=value overrides]
#   env: MODEL_PATH (default Qwen/Qwen2.5-0.5B-Instruct), DATA_DIR (default ~/data/gsm8k; built by
#   examples/data_preprocess/gsm8k.py when missing), NGPUS (default 1), PYTHON.
#   `--print-overrides` prints the key=value list one per line and exits (nothing is downloaded or run).
set -euo pipefail
RECIPE=dapo
N_SAMPLES=8 RESPONSE_LEN=1024
source "$(dirname "$0")/../common/gsm8k_gpu_setup.sh"

# algorithm: GRPO advantages + DAPO: clip-higher (0.2 / 0.28), token-level loss over the mini-batch,
# dynamic sampling (groups whose 8 samples all scored the same are dropped and more prompts generated,
# at most 10 generation rounds per step) and the soft overlong penalty over the last 256 of 1024 tokens;
# no KL loss (no reference model is built)
ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.filter_groups.enable=true
    algorithm.filter_groups.metric=score
    algorithm.filter_groups.max_num_gen_batches=10
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.use_kl_loss=false
    reward_model.reward_manager=dapo
    reward_model.overlong_buffer.enable=true
    reward_model.overlong_buffer.len=256
    reward_model.overlong_buffer.penalty_factor=1.0
)

run_recipe "$@"
