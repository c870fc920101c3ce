#!/usr/bin/env bash
# GRPO with LoRA: the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: rank-8 adapters (peft) on every linear layer of the actor, the only parameters trained and held
# by AdamW; the KL loss's reference is the same model with its adapters switched off (no second copy);
# after each update only the adapted modules, merged (W + alpha/r * B @ A), stream into vLLM
# (sync/num_tensors and sync/total_mb in the step line are smaller than a full-model run's). LoRA takes
# a larger learning rate than full fine-tuning (here 1e-3 vs the shared 1e-4). See docs/lora.md.
# Usage: STEPS=20 bash examples/grpo_lora/run_tiny_cpu.sh [key=value overrides]   (WORK=dir: where files go)
set -euo pipefail
ALG=grpo_lora
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=true
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
)
LORA=(
    actor_rollout_ref.model.lora_rank=8
    actor_rollout_ref.model.lora_alpha=16
    actor_rollout_ref.model.target_modules=all-linear
    actor_rollout_ref.actor.optim.lr=1e-3
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${LORA[@]}" "${TRAINER[@]}" "$@"
