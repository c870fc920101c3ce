"""The prepared GPU check (scripts/gpu_check.sh) runs here as a CPU dry run, without the modules the GPU
machine lacks, and builds the same config as the real loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_config_without_omegaconf_equals_the_loaders(tmp_path):
    from benchmarks.gpu_check_config import check_overrides, resolved_config
    from fusedrl.config import load_config, to_plain_dict

    for cuda in (False, True):
        overrides = check_overrides(str(tmp_path), cuda=cuda, response_length=128, n=4)
        # (Not validated: the check has no data files, and its model folder is built later.)
        assert resolved_config(overrides) == to_plain_dict(load_config(overrides, validate_config=False))


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_dry_run_passes_and_says_what_it_skipped(tmp_path):
    out = tmp_path / "dry.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["dry_run"] and summary["passed"] and summary["failed"] == []
    # It ran without Ray, vLLM, hydra and omegaconf, on the vendored tensordict.
    assert set(summary["blocked_modules"]) == {"ray", "vllm", "hydra", "omegaconf"}
    assert "fusedrl_gpu_check_deps" in summary["imports"]["tensordict"]
    checks = summary["models"]["tiny"]["checks"]
    for name in ("grpo_step", "offload_bit_identical", "pinned_host_ratio"):
        assert checks[name]["ok"] is True, (name, checks[name])
    for name in ("nccl", "device_memory_regained", "allocator_options_survive"):
        assert checks[name]["ok"] is None and "needs CUDA" in checks[name]["skipped"], name
    assert checks["grpo_step"]["changed_tensors"] == checks["grpo_step"]["tensors"] > 0
    assert checks["offload_bit_identical"]["optimizer_tensors"] > 0
    assert 1.0 <= checks["pinned_host_ratio"]["ratio"] <= 1.01
    assert summary["models"]["tiny"]["tokens_per_s"] > 0
    assert "skipped nccl: NCCL needs CUDA" in proc.stdout
    # Two steps per model, each training; the packed + compiled-layers variant too.
    for name, steps in (("tiny", 2), ("tiny+packed+compiled", 3)):
        model = summary["models"][name]
        assert model["checks"]["grpo_step"]["per_step_ok"] == [True] * steps, name
        assert all(s["update_s"] > 0 and s["old_log_prob_s"] > 0 for s in model["steps"]), name
    assert summary["models"]["tiny+packed+compiled"]["variant_overrides"] == [
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.compile_layers=true",
    ]
