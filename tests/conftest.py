"""Shared fixtures: a tiny Qwen2 model + tokenizer built locally, and arithmetic parquet data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fusedrl.utils.hardware import isolate_inductor_cache

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Eager rollout engines: compiling the model (rollout.enforce_eager=false, the default) costs 15-45 s per
# engine start, more than these short runs save. tests/integration/test_compiled_engine.py covers compiling.
os.environ.setdefault("FUSEDRL_ROLLOUT_EAGER", "1")
# What tests compile in this process (and in the workers it starts) goes to this instruction set's own
# Inductor cache, as fusedrl's own compile sites do: a graph cached under another cap (an ATEN_CPU_CAPABILITY /
# ONEDNN_MAX_CPU_ISA=AVX2 run, or another CPU sharing /tmp) computed NaN gradients here (2026-12-04).
isolate_inductor_cache()


FOLDER_MARKERS = {
    "unit": "unit",
    "integration": "integration",
    "e2e": "e2e",
    "reliability": "reliability",
    "gpu": "gpu",
}


def pytest_collection_modifyitems(config, items):
    """Each test carries its folder's marker (``-m e2e`` selects tests/e2e); GPU tests skip without CUDA."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real SmolLM2-135M-Instruct folder (float32), imported once per machine from the package
    scripts/install.sh installs (fusedrl.models.smollm2; ~50 s the first time)."""
    from fusedrl.models.smollm2 import model_dir

    return model_dir("float32", quiet=True)


@pytest.fixture(scope="session")
def smollm2_2layer_dir(tmp_path_factory, smollm2_dir: str) -> str:
    """SmolLM2 cut to its first 2 decoder layers: the real architecture, tokenizer and vocabulary."""
    from fusedrl.models.smollm2 import truncated_dir

    return truncated_dir(tmp_path_factory.mktemp("smollm2_2layer"), layers=2)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> tuple[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet

    out: Path = tmp_path_factory.mktemp("arith")
    return write_arithmetic_parquet(str(out), n_train=64, n_test=16, seed=0)


@pytest.fixture(scope="session")
def small_train_file(tmp_path_factory) -> str:
    """8 arithmetic training prompts (the real-model tests' data: two steps of 4)."""
    from fusedrl.data.arithmetic import write_arithmetic_parquet

    return write_arithmetic_parquet(str(tmp_path_factory.mktemp("arith8")), n_train=8, n_test=4, seed=0)[0]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module, for tests that build trainers with `PPOTrainer` directly."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 << 20, logging_level="WARNING")
    yield
    ray.shutdown()
