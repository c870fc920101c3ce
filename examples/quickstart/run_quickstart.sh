#!/usr/bin/env bash
# fusedrl quickstart (CPU, 2 fused workers): the whole GRPO loop on a machine with no GPU.
#
# Hardware: any 2-core Linux box, ~3 GB RAM free. Time: ~1-2 minutes after `make install`.
# What happens:
#   1. a synthetic arithmetic task is written as verl-schema parquet (train + test),
#   2. a tiny random-init Qwen2 model and a tokenizer trained on the spot are written to disk,
#   3. 20 GRPO steps run with 2 fused Ray workers (FSDP2 actor + frozen reference + in-process vLLM
#      each); every step the updated weights are streamed into vLLM in place.
# Expected output: one line per step with reward, pg_loss, kl, entropy, response length and the time
# spent in generate / old log-prob / ref / update / weight sync. (The model is random, so the reward
# stays near 0: this run shows the machinery; docs/quickstart.md grows into a run that learns.)
#
# Usage: bash examples/quickstart/run_quickstart.sh [extra key=value overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${FUSEDRL_QUICKSTART_DIR:-$ROOT/runs/quickstart}"
mkdir -p "$WORK"

# --- data and model (both built locally; nothing is downloaded)
"$PY" "$ROOT/examples/data_preprocess/arithmetic.py" --local_dir "$WORK/data" --train_size 512 --test_size 64
"$PY" -m fusedrl.utils.tiny_model --out "$WORK/model" --preset tiny --seed 0

# --- GRPO with 2 fused workers
"$PY" -m fusedrl.trainer.main_ppo \
    data.train_files="$WORK/data/train.parquet" \
    data.val_files="$WORK/data/test.parquet" \
    data.train_batch_size=8 \
    data.max_prompt_length=64 \
    data.max_response_length=16 \
    actor_rollout_ref.model.path="$WORK/model" \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.dtype=float32 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.use_kl_loss=true \
    algorithm.adv_estimator=grpo \
    trainer.n_gpus_per_node=2 \
    trainer.total_training_steps=20 \
    trainer.test_freq=10 \
    trainer.logger='[console,jsonl]' \
    trainer.default_local_dir="$WORK/run" \
    "$@"
echo "metrics: $WORK/run/metrics.jsonl"
