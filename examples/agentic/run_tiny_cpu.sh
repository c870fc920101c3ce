#!/usr/bin/env bash
# Agentic RL on CPU (2 fused workers): a tiny model learns to use a lookup tool. SFT warm start on a few
# hundred tool-call demonstrations, then GRPO with the multi-turn `tool` agent loop, beside a same-model
# no-tool baseline.
#
# Hardware: any 2-core Linux box, ~3 GB RAM free. Nothing is downloaded: the model (~0.9M parameters) and its
# tokenizer are built on the spot. Measured times and accuracies: docs/agentic.md ("CPU example").
# What happens (examples/agentic/tool_use_cpu.py):
#   1. data: 'What is the code of room "KQZ"?' (rooms AAA-ZZZ); codes come from a hidden table
#      (examples/agentic/lookup.py), 64 held-out rooms never appear in training, one SFT demonstration a room,
#   2. a small random-init Qwen2 and a tokenizer trained on the spot (with the tool-call syntax in its corpus),
#   3. SFT warm start (2 FSDP2 workers) on tool conversations; on two of the four phrasings most
#      demonstrations guess ("I think it is 512.") instead of calling the tool, so the SFT model uses the tool
#      only about half the time,
#   4. GRPO (2 fused workers: FSDP2 actor + in-process vLLM each; 16 prompts x 8 trajectories a step) with the
#      `tool` loop: generate, run <tool_call> calls, append the tool's answer, continue,
#   5. the no-tool baseline: the same model trained by SFT on direct answers (the true codes),
#   6. greedy held-out accuracy of all three, with the tool available (a multi-turn evaluator).
# Expected output: per-step log lines, then a table of held-out accuracy and the share of answers that call
# the tool; runs/agentic/summary.json.
#
# Usage: bash examples/agentic/run_tiny_cpu.sh [--seed N] [--grpo-steps N] [--out DIR] ...
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${WORK:-$ROOT/runs/agentic}"

"$PY" "$ROOT/examples/agentic/tool_use_cpu.py" --out "$WORK" "$@"
