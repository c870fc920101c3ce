"""A partial-rollout run (``async_training.partial_rollout``, fused pool, 2 workers) SIGKILLed in the middle of
step 2 resumes from checkpoint 1 and equals an uninterrupted run: the same logged metrics at every step (token
ages and carried groups included) and the same final checkpoint within float32 tolerance. Checkpoint 1 holds
a request paused half-way (its tokens, log-probs and versions); a resume that dropped it, or restarted it
from its prompt, would train other samples at step 2."""

from __future__ import annotations

import pytest
import torch
from driver_runs import driver_args, kill_mid_step_then_resume, metrics, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

PARTIAL = [
    "algorithm.rollout_correction.rollout_is=token",
    "async_training.partial_rollout=true",
    "async_training.staleness_threshold=1.0",  # 2 groups in flight per worker, 1 trained on
    "actor_rollout_ref.rollout.max_num_seqs=6",  # 8 requests per engine: some wait, and are paused
]


def test_partial_rollout_sigkill_mid_step_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, tmp_path
):
    reference = tmp_path / "reference"
    args = [*driver_args(tiny_model_dir, arithmetic_data[0], reference, reward_file), *PARTIAL]
    run_to_end(args, tmp_path / "ref.log")
    ages = [m["partial/token_age_max"] for m in metrics(reference)]
    assert ages[0] == 0.0 and max(ages) >= 1.0, ages  # some trained tokens were sampled a step earlier
    out = tmp_path / "run"

    def holds_paused_requests(out_dir) -> None:
        state = torch.load(out_dir / "global_step_1" / "partial_rollout.pt", weights_only=True)
        samples = [s for worker in state["workers"] for group in worker["groups"] for s in group]
        assert len(state["workers"]) == 2 and len(samples) == 8, len(samples)  # 1 group x 4 per worker
        assert any(s["ids"] and not s["done"] for s in samples), "no request was paused half-way"

    args = [*driver_args(tiny_model_dir, arithmetic_data[0], out, reward_file), *PARTIAL]
    kill_mid_step_then_resume(args, out, reference, tmp_path, check_killed=holds_paused_requests, step=2)
