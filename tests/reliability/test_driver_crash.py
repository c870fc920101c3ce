"""SIGKILL the driver mid-checkpoint and mid-step; the same command resumes from the last complete
checkpoint (a half-written one is never picked) and the resumed run equals an uninterrupted one: the same
logged metrics at every step and the same final checkpoint (weights, optimizer state, data position, RNG)
within float32 tolerance."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

# The driver script: `main_ppo`, with two places where the run can be made to hang so the test can kill it
# exactly there:
# * HANG_IN_COMMIT_AT=N: checkpoint N's temp folder is fully written, the rename has not happened;
# * HANG_IN_STEP_AT=N: inside step N, after the actor update and before the engine's weight sync (the
#   workers' in-memory state has moved past the last checkpoint).
DRIVER = textwrap.dedent(
    """
    import os, sys, time
    import fusedrl.checkpoint as ckpt
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    def hang_if(var, step, what):
        if str(step) == os.environ.get(var, ""):
            print(f"{what} {step}", flush=True)
            time.sleep(3600)
    real_commit = ckpt.commit_checkpoint
    def slow_commit(root, step, tmp, max_to_keep=None):
        hang_if("HANG_IN_COMMIT_AT", step, "HANGING_IN_COMMIT")
        return real_commit(root, step, tmp, max_to_keep=max_to_keep)
    ckpt.commit_checkpoint = slow_commit
    real_sync = PPOTrainer.sync_weights
    def slow_sync(self):
        hang_if("HANG_IN_STEP_AT", self.global_step, "HANGING_IN_STEP")
        return real_sync(self)
    PPOTrainer.sync_weights = slow_sync
    from fusedrl.trainer.main_ppo import main
    sys.exit(main(sys.argv[1:]))
    """
)

# Metrics that measure the machine (wall-clock time, throughput, memory), not the computation.
NONDETERMINISTIC_PREFIXES = ("timing_", "perf/", "memory/")

# The tiny random model never solves the arithmetic task (every reward 0, so no gradient): score the
# response length instead, so every step really updates the policy. The reward also draws from the
# driver's global RNGs, as user code may: the final checkpoints' RNG states agree only if a fresh run seeds
# them and a resumed run restores them.
REWARD = """
import random
import numpy as np
import torch

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    random.random(), np.random.rand(), torch.rand(1)
    return (len(solution_str) % 5) / 4.0
"""


def _args(model_dir, train_file, out_dir, reward_file) -> list[str]:
    return [
        f"data.train_files={train_file}",
        f"actor_rollout_ref.model.path={model_dir}",
        f"custom_reward_function.path={reward_file}",
        "data.train_batch_size=2",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={out_dir}",
    ]


def _start(args, env_extra, log_path):
    env = {**os.environ, **env_extra}
    log = open(log_path, "w")  # noqa: SIM115 (closed by the caller through the process)
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def _run_to_end(args, log_path, timeout=600) -> str:
    proc = _start(args, {}, log_path)
    try:
        assert proc.wait(timeout=timeout) == 0, _read(log_path)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return _read(log_path)


def _run_and_kill_at(args, env_extra, needle, log_path):
    """Start the driver, wait until it prints ``needle`` (it then hangs), SIGKILL it."""
    proc = _start(args, env_extra, log_path)
    try:
        _wait_for(log_path, needle, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return _read(log_path)


def _read(path) -> str:
    return path.read_text() if path.exists() else ""


def _wait_for(path, needle, proc, timeout=500):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in _read(path):
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited early:\n{_read(path)[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {needle!r}:\n{_read(path)[-3000:]}")


def _metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in _read(out_dir / "metrics.jsonl").splitlines()]


def _assert_same_metrics(step, expected: dict, actual: dict) -> None:
    keys = {k for k in expected if not k.startswith(NONDETERMINISTIC_PREFIXES)}
    assert keys == {k for k in actual if not k.startswith(NONDETERMINISTIC_PREFIXES)}, step
    for key in sorted(keys):
        e, a = expected[key], actual[key]
        if isinstance(e, float) and math.isnan(e):
            assert isinstance(a, float) and math.isnan(a), (step, key, e, a)
        else:
            assert a == pytest.approx(e, rel=1e-5, abs=1e-6), (step, key, e, a)


def _assert_same_checkpoint(expected_dir, actual_dir) -> None:
    """Same files; every tensor (weights, optimizer moments, RNG) within float32 tolerance; same JSON."""
    import torch
    from safetensors.torch import load_file

    files = sorted(
        os.path.relpath(os.path.join(d, f), expected_dir) for d, _, fs in os.walk(expected_dir) for f in fs
    )
    assert files == sorted(
        os.path.relpath(os.path.join(d, f), actual_dir) for d, _, fs in os.walk(actual_dir) for f in fs
    )
    compared = 0
    for rel in files:
        if rel.endswith(".safetensors"):
            e, a = load_file(expected_dir / rel), load_file(actual_dir / rel)
            assert sorted(e) == sorted(a), rel
            for name, t in e.items():
                if t.is_floating_point():
                    assert torch.allclose(a[name], t, rtol=1e-5, atol=1e-6), (rel, name)
                else:
                    assert torch.equal(a[name], t), (rel, name)
                compared += 1
        elif rel.endswith(".json"):
            e_json = json.loads((expected_dir / rel).read_text())
            a_json = json.loads((actual_dir / rel).read_text())
            assert a_json == e_json, rel  # step counter, data-loader position, driver RNG, shard layout
    assert compared > 0


def test_sigkill_mid_checkpoint_and_mid_step_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, tmp_path
):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD)
    # 0) The reference: the same 4 steps, uninterrupted.
    ref = tmp_path / "reference"
    _run_to_end(_args(tiny_model_dir, arithmetic_data[0], ref, reward_file), tmp_path / "reference.log")

    out = tmp_path / "run"
    args = _args(tiny_model_dir, arithmetic_data[0], out, reward_file)
    # 1) Killed while writing checkpoint 2: step 1's checkpoint is the last complete one.
    _run_and_kill_at(args, {"HANG_IN_COMMIT_AT": "2"}, "HANGING_IN_COMMIT 2", tmp_path / "run1.log")
    names = sorted(os.listdir(out))
    assert "global_step_1" in names and "global_step_2" not in names
    assert any(n.startswith("global_step_2.tmp") for n in names), names  # the half-written one
    # 2) Same command: resumes from step 1 (not the temp folder); killed in the middle of step 3, after its
    #    actor update (the workers' state has moved on, checkpoint 2 is the last complete one).
    text = _run_and_kill_at(args, {"HANG_IN_STEP_AT": "3"}, "HANGING_IN_STEP 3", tmp_path / "run2.log")
    assert "global_step_1 at step 1" in text, text[-3000:]
    names = sorted(os.listdir(out))
    assert "global_step_2" in names and "global_step_3" not in names, names
    # 3) Same command again: resumes from checkpoint 2 and finishes at step 4.
    text = _run_to_end(args, tmp_path / "run3.log")
    assert "global_step_2 at step 2" in text, text[-3000:]
    assert not any(".tmp" in n for n in os.listdir(out)), "stale temp folders must be cleaned up"

    # Every step was logged exactly once (1 by the first run, 2 by the second, 3-4 by the third) and
    # equals the uninterrupted run's: same prompts, samples, rewards, losses, grad norms, KL...
    expected, actual = _metrics(ref), _metrics(out)
    assert [m["step"] for m in expected] == [1, 2, 3, 4]
    assert [m["step"] for m in actual] == [1, 2, 3, 4]
    assert all(m["actor/grad_norm"] > 0 for m in expected), "every step must update the policy"
    for e, a in zip(expected, actual):
        _assert_same_metrics(e["step"], e, a)
    # ... and the final checkpoints (policy, optimizer, data position, RNG) agree.
    _assert_same_checkpoint(ref / "global_step_4", out / "global_step_4")
