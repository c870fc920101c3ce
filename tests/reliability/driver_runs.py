"""Helpers for the reliability tests that run the real `main_ppo` driver as a subprocess (importable as
``driver_runs``: pytest puts this folder on ``sys.path``).

The runs all use `driver_args`: 4 steps of the tiny model on 2 fused workers, a checkpoint per step, a reward
that varies and draws from the driver's RNGs. ``conftest.reference_run`` runs those 4 steps once,
uninterrupted, per session; each test compares its interrupted-and-resumed run against it with
`assert_same_metrics` / `assert_same_checkpoint`.
"""

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
from support import FLOAT32_TRAINING

# The driver script: `main_ppo`, with places where the run can be made to wait so a test can kill or signal
# it exactly there:
# * HANG_IN_COMMIT_AT=N: checkpoint N's temp folder is fully written, the rename has not happened;
# * HANG_IN_STEP_AT=N: inside step N, right after the actor update, before the engine's weight sync (the
#   workers' in-memory state has moved past the last checkpoint). (It waits in `update_actor`, not in
#   `sync_weights`: the driver also calls the sync before every rollout, where the workers decide.)
# * PAUSE_IN_STEP_AT=N: the same place, but the step goes on after PAUSE_S seconds (a signal sent during the
#   pause arrives in the middle of step N).
DRIVER = textwrap.dedent(
    """
    import os, sys, time
    import fusedrl.checkpoint as ckpt
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    def hang_if(var, step, what, seconds=3600):
        if str(step) == os.environ.get(var, ""):
            print(f"{what} {step}", flush=True)
            time.sleep(seconds)
    real_commit = ckpt.commit_checkpoint
    def slow_commit(root, step, tmp, max_to_keep=None):
        hang_if("HANG_IN_COMMIT_AT", step, "HANGING_IN_COMMIT")
        return real_commit(root, step, tmp, max_to_keep=max_to_keep)
    ckpt.commit_checkpoint = slow_commit
    real_update = PPOTrainer.update_actor
    def slow_update(self, batch):
        metrics = real_update(self, batch)
        hang_if("HANG_IN_STEP_AT", self.global_step, "HANGING_IN_STEP")
        hang_if("PAUSE_IN_STEP_AT", self.global_step, "PAUSED_IN_STEP", float(os.environ.get("PAUSE_S", "0")))
        return metrics
    PPOTrainer.update_actor = slow_update
    from fusedrl.trainer.main_ppo import main
    sys.exit(main(sys.argv[1:]))
    """
)

# Metrics that measure the machine (wall-clock time, throughput, memory), not the computation.
NONDETERMINISTIC_PREFIXES = ("timing_", "perf/", "memory/")


def measures_the_machine(key: str) -> bool:
    """Wall-clock, throughput and memory metrics, and the seconds of the async overlap and of the weight
    broadcast to a rollout pool (``async/*_s``, ``sync/*_s``)."""
    return key.startswith(NONDETERMINISTIC_PREFIXES) or (
        key.startswith(("async/", "sync/")) and key.endswith("_s")
    )


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


def driver_args(model_dir, train_file, out_dir, reward_file, save_freq=1) -> list[str]:
    """The command line of every driver run here (``save_freq``: checkpoint every N steps and the last)."""
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
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        f"trainer.save_freq={save_freq}",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={out_dir}",
    ]


def start_driver(args, env_extra, log_path):
    env = {**os.environ, **env_extra}
    log = open(log_path, "w")  # noqa: SIM115 (closed by the caller through the process)
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def run_to_end(args, log_path, timeout=600, env_extra=None, expect_rc=0) -> str:
    """Run the driver to its exit; it must exit with ``expect_rc``. Returns its output."""
    proc = start_driver(args, env_extra or {}, log_path)
    try:
        assert proc.wait(timeout=timeout) == expect_rc, read(log_path)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return read(log_path)


def run_and_kill_at(args, env_extra, needle, log_path):
    """Start the driver, wait until it prints ``needle`` (it then hangs), SIGKILL it."""
    proc = start_driver(args, env_extra, log_path)
    try:
        wait_for(log_path, needle, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return read(log_path)


def read(path) -> str:
    return path.read_text() if path.exists() else ""


def wait_for(path, needle, proc, timeout=500):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in read(path):
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited early:\n{read(path)[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {needle!r}:\n{read(path)[-3000:]}")


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in read(out_dir / "metrics.jsonl").splitlines()]


def assert_same_metrics(step, expected: dict, actual: dict) -> None:
    keys = {k for k in expected if not measures_the_machine(k)}
    assert keys == {k for k in actual if not measures_the_machine(k)}, step
    for key in sorted(keys):
        e, a = expected[key], actual[key]
        if isinstance(e, float) and math.isnan(e):
            assert isinstance(a, float) and math.isnan(a), (step, key, e, a)
        else:
            assert a == pytest.approx(e, rel=1e-5, abs=1e-6), (step, key, e, a)


def assert_same_checkpoint(expected_dir, actual_dir) -> None:
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


def assert_resumed_run_equals_reference(reference, run, steps) -> None:
    """``run``'s metrics.jsonl logged ``steps`` exactly once each, equal to the reference's at the same steps,
    and its final checkpoint (global_step_4) equals the reference's."""
    expected = {m["step"]: m for m in metrics(reference)}
    assert sorted(expected) == [1, 2, 3, 4]
    actual = metrics(run)
    assert [m["step"] for m in actual] == list(steps)
    assert all(expected[s]["actor/grad_norm"] > 0 for s in steps), "every step must update the policy"
    for a in actual:
        assert_same_metrics(a["step"], expected[a["step"]], a)
    assert_same_checkpoint(reference / "global_step_4", run / "global_step_4")


def kill_mid_step_then_resume(args, out, reference, tmp_path, check_killed=None, step: int = 3) -> None:
    """SIGKILL a run of ``args`` (writing into ``out``) inside step ``step`` (3 unless told; after the update,
    before the engine's weight sync: checkpoint ``step - 1`` is the last; ``check_killed(out_dir)`` may look at
    it then), resume it from there, and check it equals the uninterrupted ``reference`` run at every step
    (steps before ``step`` logged by the killed run, the rest by the resumed one) and in its final checkpoint."""
    run_and_kill_at(args, {"HANG_IN_STEP_AT": str(step)}, f"HANGING_IN_STEP {step}", tmp_path / "run1.log")
    names = sorted(os.listdir(out))
    assert f"global_step_{step - 1}" in names and f"global_step_{step}" not in names, names
    if check_killed is not None:
        check_killed(out)
    text = run_to_end(args, tmp_path / "run2.log")
    assert f"global_step_{step - 1} at step {step - 1}" in text, text[-3000:]
    assert_resumed_run_equals_reference(reference, out, [1, 2, 3, 4])
