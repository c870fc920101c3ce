"""SIGTERM on the driver in the middle of a step (as a cluster scheduler preempting the job): the step is
finished, checkpointed although trainer.save_freq would not save it, the workers are stopped and the driver
exits with 75; rerunning the same command resumes and equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import time

import pytest
from driver_runs import (
    assert_resumed_run_equals_reference,
    driver_args,
    metrics,
    read,
    run_to_end,
    start_driver,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")


def test_sigterm_mid_step_checkpoints_that_step_and_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, reference_run, tmp_path
):
    out = tmp_path / "run"
    args = driver_args(tiny_model_dir, arithmetic_data[0], out, reward_file, save_freq=3)
    log = tmp_path / "preempted.log"
    # Step 2 pauses for 3 s after its actor update; SIGTERM arrives during the pause.
    proc = start_driver(args, {"PAUSE_IN_STEP_AT": "2", "PAUSE_S": "3"}, log)
    try:
        wait_for(log, "PAUSED_IN_STEP 2", proc)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stopped_in = time.monotonic() - signalled
    text = read(log)
    assert rc == 75, text[-3000:]
    assert stopped_in < 300, stopped_in  # trainer.preemption_save_timeout_s (default 300)
    assert "received SIGTERM: finishing the current step" in text, text[-3000:]
    assert f"stopped after step 2; saved {out / 'global_step_2'}" in text, text[-3000:]
    assert "rerun the same command" in text, text[-3000:]
    # save_freq=3 would have saved nothing yet: this is the preemption checkpoint of the finished step 2.
    assert sorted(n for n in os.listdir(out) if n.startswith("global_step")) == ["global_step_2"]
    assert [m["step"] for m in metrics(out)] == [1, 2]

    text = run_to_end(args, tmp_path / "resumed.log")
    assert f"resumed from {out / 'global_step_2'} at step 2" in text, text[-3000:]
    assert_resumed_run_equals_reference(reference_run, out, [1, 2, 3, 4])
