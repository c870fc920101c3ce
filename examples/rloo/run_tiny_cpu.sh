#!/usr/bin/env bash
# RLOO (REINFORCE leave-one-out): the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: each sample's baseline is the mean reward of the other samples of its prompt; the KL to the
# frozen reference is a penalty inside the reward (use_kl_in_reward, fixed coefficient) rather than a
# loss term. One log line per step.
# The model is random-init, so the reward is mostly the 0.1 partial credit for answering with a number
# (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent learning arithmetic.
# Usage: STEPS=20 bash examples/rloo/run_tiny_cpu.sh [key=value overrides]   (WORK=dir: where files go)
set -euo pipefail
ALG=rloo
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=rloo
    algorithm.use_kl_in_reward=true
    algorithm.kl_penalty=kl
    algorithm.kl_ctrl.type=fixed
    algorithm.kl_ctrl.kl_coef=0.001
    actor_rollout_ref.actor.use_kl_loss=false
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
