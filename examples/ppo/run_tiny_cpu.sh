#!/usr/bin/env bash
# PPO with GAE: the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: the critic role (built only for adv_estimator=gae) computing values, GAE advantages
# (gamma 1.0, lambda 0.95), a clipped value-loss update of the critic, then the PPO actor update without
# a KL loss (so no reference model is built); one log line per step.
# The model is random-init, so the reward is mostly the 0.1 partial credit for answering with a number
# (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent learning arithmetic.
# Usage: STEPS=20 bash examples/ppo/run_tiny_cpu.sh [key=value overrides]   (WORK=dir: where files go)
set -euo pipefail
ALG=ppo
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=gae
    algorithm.gamma=1.0
    algorithm.lam=0.95
    critic.optim.lr=1e-3
    actor_rollout_ref.actor.use_kl_loss=false
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
