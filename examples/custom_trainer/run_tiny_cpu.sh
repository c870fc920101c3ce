#!/usr/bin/env bash
# A custom trainer, CPU: a PPOTrainer subclass that overrides one step (compute_advantages: GRPO's
# advantages, then clipped to [-1, 1]), run through run_ppo(config, trainer_cls=...) by
# custom_advantage.py. 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows: before each step's log line, "advantage clip (step N): X% of response tokens clipped to [-1, 1]".
# With 4 samples per prompt a GRPO advantage reaches 1.5 when one sample of the group scores higher than
# the other three, so some of the tokens are clipped (about 10% per step in a 2-step run here).
# The model is random-init, so the reward is mostly the 0.1 partial credit for answering with a number
# (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent learning arithmetic.
# Usage: STEPS=20 bash examples/custom_trainer/run_tiny_cpu.sh [key=value overrides]
#        (WORK=dir: where files go; any estimator works, e.g. algorithm.adv_estimator=rloo)
set -euo pipefail
ALG=custom_trainer
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=grpo
    actor_rollout_ref.actor.use_kl_loss=true
)
"$PY" "$ROOT/examples/custom_trainer/custom_advantage.py" \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
