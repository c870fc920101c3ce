#!/usr/bin/env bash
# tests/gpu on a bare GPU machine: Python with torch (CUDA), transformers and pytest, no network, no fusedrl
# install. fusedrl and the vendored tensordict wheels go into a folder of their own (no dependencies pulled),
# and pytest runs from outside the repository so its top-level `fusedrl/` does not shadow that install.
# The prepared check (`scripts/gpu_check.sh`) is the suite's last test; `-k "not prepared"` leaves it out
# when it runs on its own. See docs/gpu.md.
#
#   scripts/gpu_tests.sh                    # all of tests/gpu
#   scripts/gpu_tests.sh -k "not prepared"  # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # pytest runs elsewhere; keep a venv link
SITE="${FUSEDRL_GPU_SITE:-$(mktemp -d)}"
if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target "$SITE" \
    "$ROOT" "$ROOT"/scripts/gpu_wheels/*.whl >"$SITE.pip.log" 2>&1; then
    cat "$SITE.pip.log" >&2
    echo "gpu_tests: installing fusedrl into $SITE failed (log above)" >&2
    exit 1
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
cd "$(mktemp -d)"
exec "$PY" -m pytest "$ROOT/tests/gpu" -m gpu -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "$@"
