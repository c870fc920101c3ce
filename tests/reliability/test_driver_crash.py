"""SIGKILL the driver mid-checkpoint and mid-step; the same command resumes from the last complete
checkpoint (a half-written one is never picked) and the resumed run equals an uninterrupted one: the same
logged metrics at every step and the same final checkpoint (weights, optimizer state, data position, RNG)
within float32 tolerance."""

from __future__ import annotations

import os

import pytest
from driver_runs import assert_resumed_run_equals_reference, driver_args, run_and_kill_at, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")


def test_sigkill_mid_checkpoint_and_mid_step_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, reference_run, tmp_path
):
    out = tmp_path / "run"
    args = driver_args(tiny_model_dir, arithmetic_data[0], out, reward_file)
    # 1) Killed while writing checkpoint 2: step 1's checkpoint is the last complete one.
    run_and_kill_at(args, {"HANG_IN_COMMIT_AT": "2"}, "HANGING_IN_COMMIT 2", tmp_path / "run1.log")
    names = sorted(os.listdir(out))
    assert "global_step_1" in names and "global_step_2" not in names
    assert any(n.startswith("global_step_2.tmp") for n in names), names  # the half-written one
    # 2) Same command: resumes from step 1 (not the temp folder); killed in the middle of step 3, after its
    #    actor update (the workers' state has moved on, checkpoint 2 is the last complete one).
    text = run_and_kill_at(args, {"HANG_IN_STEP_AT": "3"}, "HANGING_IN_STEP 3", tmp_path / "run2.log")
    assert "global_step_1 at step 1" in text, text[-3000:]
    names = sorted(os.listdir(out))
    assert "global_step_2" in names and "global_step_3" not in names, names
    # 3) Same command again: resumes from checkpoint 2 and finishes at step 4.
    text = run_to_end(args, tmp_path / "run3.log")
    assert "global_step_2 at step 2" in text, text[-3000:]
    assert not any(".tmp" in n for n in os.listdir(out)), "stale temp folders must be cleaned up"

    # Every step was logged exactly once (1 by the first run, 2 by the second, 3-4 by the third) and
    # equals the uninterrupted run's: same prompts, samples, rewards, losses, grad norms, KL... and the
    # final checkpoints (policy, optimizer, data position, RNG) agree.
    assert_resumed_run_equals_reference(reference_run, out, [1, 2, 3, 4])
