"""The quickstart task learned with one-step-off async training: the quickstart script (SFT warm-start,
then GRPO) with the rollout on a pool of its own and ``async_training.max_staleness=1``. The GRPO stage
must raise the held-out greedy accuracy above the SFT warm-start's as the synchronous quickstart does
(tests/e2e/test_echo_smoke.py), and every step's samples must have been at most one update old."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart" / "echo_smoke.py"
ASYNC = [
    "trainer.n_gpus_per_node=1",
    "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
    "trainer.placement.roles={rollout: gen}",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "algorithm.rollout_correction.rollout_is=token",
    "async_training.max_staleness=1",
]


@pytest.mark.slow
def test_quickstart_learns_with_one_step_off_async(tmp_path):
    out = tmp_path / "quickstart"
    extra = [arg for ov in ASYNC for arg in ("--grpo-set", ov)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--grpo-steps", "20", "--test-freq", "10", *extra],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 < summary["sft_acc"] < 0.9, summary
    assert summary["grpo_acc"] >= summary["sft_acc"] + 0.10, summary
    steps = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in steps if "async/staleness_max" in m]
    assert len(train) == 20
    assert [m["async/staleness_max"] for m in train] == [0.0] + [1.0] * 19
    assert all(m["async/actor_version"] == m["step"] - 1 for m in train)
