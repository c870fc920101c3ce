#!/usr/bin/env bash
# GRPO, CPU twin: 2 fused workers, a tiny locally-built Qwen2, the synthetic arithmetic task.
#
# Hardware: 2 CPU cores. Time: ~1 minute. Expected: per-step log lines; reward near 0 (random model).
# Usage: bash examples/grpo/run_tiny_cpu.sh [key=value overrides]   (e.g. trainer.total_training_steps=50)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${WORK:-$ROOT/runs/grpo_tiny_cpu}"
mkdir -p "$WORK"
[ -f "$WORK/data/train.parquet" ] || "$PY" "$ROOT/examples/data_preprocess/arithmetic.py" --local_dir "$WORK/data"
[ -f "$WORK/model/config.json" ] || "$PY" -m fusedrl.utils.tiny_model --out "$WORK/model"

# data
DATA=(
    data.train_files="$WORK/data/train.parquet"
    data.train_batch_size=8
    data.max_prompt_length=64
    data.max_response_length=16
)
# model, actor, rollout
MODEL=(
    actor_rollout_ref.model.path="$WORK/model"
    actor_rollout_ref.actor.optim.lr=1e-4
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.dtype=float32
)
# algorithm and trainer
TRAINER=(
    algorithm.adv_estimator=grpo
    trainer.n_gpus_per_node=2
    trainer.total_training_steps=10
    trainer.default_local_dir="$WORK/run"
)
"$PY" -m fusedrl.trainer.main_ppo "${DATA[@]}" "${MODEL[@]}" "${TRAINER[@]}" "$@"
