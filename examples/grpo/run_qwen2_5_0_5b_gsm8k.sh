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
RECIPE=grpo
source "$(dirname "$0")/../common/gsm8k_gpu_setup.sh"

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

run_recipe "$@"
