#!/usr/bin/env bash
# fusedrl echo smoke run (the first quickstart; CPU, 2 fused workers): SFT warm-start, then GRPO, against an SFT-only baseline.
#
# Hardware: any 2-core Linux box, ~3 GB RAM free. Time: ~10 minutes after `make install` (9.5-11.5 measured on a loaded box).
# What happens (examples/quickstart/echo_smoke.py; docs/quickstart.md explains each stage):
#   1. a synthetic "echo" task (repeat a 3-digit number) is written as parquet: SFT demonstrations, RL
#      prompts and 64 held-out test prompts whose numbers never appear in training,
#   2. a small random-init Qwen2 (~0.9M parameters) and a tokenizer trained on the spot are written to disk,
#   3. SFT warm-start with 2 FSDP2 workers: the demonstrations mix a short answer ("482.") with a verbose
#      one ("482. Reversed: 284.") that the verifier rejects, so the model reaches only partial accuracy,
#   4. GRPO with 2 fused Ray workers (FSDP2 actor + in-process vLLM each; 16 prompts x 8 samples a step),
#      held-out greedy accuracy measured every 2 steps,
#   5. an SFT-only baseline: the warm-start model trained further on the same SFT data for the same wall
#      time as the GRPO loop.
# Expected output: per-step log lines, then a table of held-out greedy accuracy for the SFT model, the
# SFT-only baseline and the GRPO model, and runs/quickstart/quickstart.png (reward and accuracy over steps).
#
# Usage: bash examples/quickstart/run_echo_smoke.sh [--seed N] [--grpo-steps N] [--out DIR] ...
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${FUSEDRL_QUICKSTART_DIR:-$ROOT/runs/echo_smoke}"

"$PY" "$ROOT/examples/quickstart/echo_smoke.py" --out "$WORK" "$@"
