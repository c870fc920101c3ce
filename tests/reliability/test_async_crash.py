"""A one-step-off async run (rollout on a pool of its own, ``async_training.max_staleness=1``) SIGKILLed in
the middle of a step resumes from its last checkpoint and equals an uninterrupted async run: the same logged
metrics at every step (staleness and policy versions included) and the same final checkpoint within float32
tolerance. Checkpoint 2 holds the batch that was generated during step 2 by policy version 1; a resume that
regenerated it with the restored (newer) weights would give other samples and other metrics."""

from __future__ import annotations

import os

import pytest
from driver_runs import (
    driver_args,
    kill_mid_step_then_resume,
    metrics,
    run_to_end,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

ASYNC = [
    "trainer.n_gpus_per_node=1",
    "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
    "trainer.placement.roles={rollout: gen}",
    "algorithm.rollout_correction.rollout_is=token",
    "async_training.max_staleness=1",
]


def _args(model_dir, train_file, out, reward_file) -> list[str]:
    base = [a for a in driver_args(model_dir, train_file, out, reward_file) if "n_gpus_per_node" not in a]
    return [*base, *ASYNC]


def test_async_sigkill_mid_step_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, tmp_path
):
    reference = tmp_path / "reference"
    run_to_end(_args(tiny_model_dir, arithmetic_data[0], reference, reward_file), tmp_path / "ref.log")
    staleness = [m["async/staleness_max"] for m in metrics(reference)]
    assert staleness == [0.0, 1.0, 1.0, 1.0], staleness  # really one step off from step 2 on
    out = tmp_path / "run"
    args = _args(tiny_model_dir, arithmetic_data[0], out, reward_file)

    def holds_the_next_batch(out_dir) -> None:  # generated during step 2 by policy version 1
        assert os.path.isfile(out_dir / "global_step_2" / "async_batch.safetensors")

    # Killed inside step 3, after the update and after the next batch was generated, before the sync.
    kill_mid_step_then_resume(args, out, reference, tmp_path, check_killed=holds_the_next_batch)
