"""SIGKILL the driver mid-checkpoint and mid-step; the same command resumes from the last complete
checkpoint (a half-written one is never picked) and finishes with the right step count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

# The driver script: `main_ppo`, except that committing a checkpoint can be made to hang at a chosen step
# (the temp folder is fully written, the rename has not happened) so the test can kill it right there.
DRIVER = textwrap.dedent(
    """
    import os, sys, time
    import fusedrl.checkpoint as ckpt
    real_commit = ckpt.commit_checkpoint
    def slow_commit(root, step, tmp, max_to_keep=None):
        if str(step) == os.environ.get("HANG_IN_COMMIT_AT", ""):
            print(f"HANGING_IN_COMMIT {step}", flush=True)
            time.sleep(3600)
        return real_commit(root, step, tmp, max_to_keep=max_to_keep)
    ckpt.commit_checkpoint = slow_commit
    from fusedrl.trainer.main_ppo import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _start(args, env_extra, log_path):
    env = {**os.environ, **env_extra}
    log = open(log_path, "w")  # noqa: SIM115 (closed by the caller through the process)
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def _read(path) -> str:
    return path.read_text() if path.exists() else ""


def _wait_for(path, needle, proc, timeout=400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in _read(path):
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited early:\n{_read(path)[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {needle!r}:\n{_read(path)[-3000:]}")


def test_sigkill_mid_checkpoint_and_mid_step_then_resume(tiny_model_dir, arithmetic_data, tmp_path):
    out = tmp_path / "run"
    args = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=2",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={out}",
    ]
    # 1) Killed while writing checkpoint 2: step 1's checkpoint is the last complete one.
    log1 = tmp_path / "run1.log"
    p1 = _start(args, {"HANG_IN_COMMIT_AT": "2"}, log1)
    _wait_for(log1, "HANGING_IN_COMMIT 2", p1)
    os.kill(p1.pid, signal.SIGKILL)
    p1.wait()
    names = sorted(os.listdir(out))
    assert "global_step_1" in names and "global_step_2" not in names
    assert any(n.startswith("global_step_2.tmp") for n in names), names  # the half-written one
    # 2) Same command: resumes from step 1 (not the temp folder); killed mid-step after checkpoint 3.
    log2 = tmp_path / "run2.log"
    p2 = _start(args, {}, log2)
    _wait_for(log2, "resumed from", p2)
    assert "global_step_1 at step 1" in _read(log2)
    _wait_for(log2, "step 3 |", p2)
    while not (out / "global_step_3").exists():
        time.sleep(0.2)
    time.sleep(1.0)  # now inside step 4
    os.kill(p2.pid, signal.SIGKILL)
    p2.wait()
    # 3) Same command again: resumes from the last complete checkpoint and finishes at step 4.
    log3 = tmp_path / "run3.log"
    p3 = _start(args, {}, log3)
    assert p3.wait(timeout=600) == 0, _read(log3)[-3000:]
    text = _read(log3)
    last = max(
        int(n.split("_")[-1]) for n in os.listdir(out) if n.startswith("global_step_") and "." not in n
    )
    assert last == 4
    resumed_at = int(text.split("resumed from")[1].split("at step")[1].split()[0])
    assert resumed_at in (3, 4)
    assert not any(".tmp" in n for n in os.listdir(out)), "stale temp folders must be cleaned up"
    steps = [json.loads(line)["step"] for line in _read(out / "metrics.jsonl").splitlines()]
    assert max(steps) == 4 and 4 in steps
