#!/usr/bin/env bash
# Dr. GRPO ("GRPO done right"): the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: GRPO with its two biases removed: advantages are reward minus the group mean (no division by
# the group's std) and each sequence's token losses are summed and divided by a constant
# (seq-mean-token-sum-norm) instead of by its length; no KL loss. One log line per step.
# The model is random-init, so the reward is mostly the 0.1 partial credit for answering with a number
# (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent learning arithmetic.
# Usage: STEPS=20 bash examples/drgrpo/run_tiny_cpu.sh [key=value overrides]   (WORK=dir: where files go)
set -euo pipefail
ALG=drgrpo
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=false
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm
    actor_rollout_ref.actor.use_kl_loss=false
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
