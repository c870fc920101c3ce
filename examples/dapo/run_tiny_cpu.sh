#!/usr/bin/env bash
# DAPO: the CPU twin of run_qwen2_5_0_5b_gsm8k.sh.
# 2 fused workers, a tiny locally built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores, ~3 GB RAM free. Time: ~1-2 minutes (4 steps; the first ~1 min is start-up).
# Shows DAPO's four changes to GRPO: asymmetric clipping (clip-higher: 0.2 below, 0.28 above),
# token-level loss averaging over the whole mini-batch, dynamic sampling (groups whose samples all scored
# the same are dropped and more prompts generated until 8 informative groups are collected; metric
# filter_groups/num_gen_batches) and the soft overlong penalty (the dapo reward manager subtracts up to
# 1.0 from responses that run into the last 4 of the 16 allowed tokens, hence the negative reward).
# No KL loss. One log line per step.
# The model is random-init, so its reward is mostly the overlong penalty plus the 0.1 partial credit for
# answering with a number (see examples/common/tiny_setup.sh): the run shows the machinery, not an agent
# learning arithmetic.
# Usage: STEPS=20 bash examples/dapo/run_tiny_cpu.sh [key=value overrides]   (WORK=dir: where files go)
set -euo pipefail
ALG=dapo
source "$(dirname "$0")/../common/tiny_setup.sh"

ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.filter_groups.enable=true
    algorithm.filter_groups.metric=score
    algorithm.filter_groups.max_num_gen_batches=30
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.use_kl_loss=false
    reward_model.reward_manager=dapo
    reward_model.overlong_buffer.enable=true
    reward_model.overlong_buffer.len=4
    reward_model.overlong_buffer.penalty_factor=1.0
)
"$PY" -m fusedrl.trainer.main_ppo \
    "${DATA[@]}" "${MODEL[@]}" "${REWARD[@]}" "${ALGORITHM[@]}" "${TRAINER[@]}" "$@"
