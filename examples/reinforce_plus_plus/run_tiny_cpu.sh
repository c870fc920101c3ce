#!/usr/bin/env bash
# REINFORCE++: the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: no critic and no group baseline: token-level returns of the KL-penalised reward
# (use_kl_in_reward, adaptive KL coefficient), whitened over the whole batch. One log line per step.
# The model is random-init, so the reward is mostly the 0.1 partial credit for answering with a number
# (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent learning arithmetic.
# Usage: STEPS=20 bash examples/reinforce_plus_plus/run_tiny_cpu.sh [key=value overrides]
#        (WORK=dir: where files go)
set -euo pipefail
ALG=reinforce_plus_plus
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=reinforce_plus_plus
    algorithm.gamma=1.0
    algorithm.use_kl_in_reward=true
    algorithm.kl_penalty=kl
    algorithm.kl_ctrl.type=adaptive
    algorithm.kl_ctrl.kl_coef=0.001
    algorithm.kl_ctrl.target_kl=0.1
    algorithm.kl_ctrl.horizon=10000
    actor_rollout_ref.actor.use_kl_loss=false
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
