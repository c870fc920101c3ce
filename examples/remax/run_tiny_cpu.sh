#!/usr/bin/env bash
# ReMax: the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: every step also generates one greedy response per prompt (rollout.val_kwargs) and uses its
# reward as the baseline of that prompt's sampled responses; no critic, no KL loss. One log line per step.
# The model is random-init, so the reward is mostly the 0.1 partial credit for answering with a number
# (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent learning arithmetic.
# Usage: STEPS=20 bash examples/remax/run_tiny_cpu.sh [key=value overrides]   (WORK=dir: where files go)
set -euo pipefail
ALG=remax
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=remax
    actor_rollout_ref.actor.use_kl_loss=false
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
