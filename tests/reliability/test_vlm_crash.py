"""A GRPO run on image prompts (the tiny random Qwen2.5-VL, generated shape pictures: tests/vlm_support.py)
SIGKILLed in the middle of step 2 resumes from checkpoint 1 and equals an uninterrupted run: the same logged
metrics at every step and the same final checkpoint within float32 tolerance. A resume that lost the rows'
images, gave a row another row's picture or restarted the data loader elsewhere would sample and train
other tokens at steps 2-4 (the engine's log-probs of a row's tokens depend on its picture: docs/multimodal.md)."""

from __future__ import annotations

import pytest
from driver_runs import driver_args, kill_mid_step_then_resume, metrics, run_to_end
from vlm_support import tiny_vlm_and_shapes

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

VLM = [
    "data.max_prompt_length=48",  # driver_args' 2 fused workers: each rank's rows and their images
    "actor_rollout_ref.rollout.calculate_log_probs=true",  # the engine's log-probs checked on every step
]


def test_image_run_sigkill_mid_step_then_resume_equals_uninterrupted(reward_file, tmp_path_factory, tmp_path):
    model_dir, train = tiny_vlm_and_shapes(tmp_path_factory)
    reference = tmp_path / "reference"
    run_to_end([*driver_args(model_dir, train, reference, reward_file), *VLM], tmp_path / "ref.log")
    assert all(
        m["rollout/log_prob_abs_diff_max"] < 1e-4 for m in metrics(reference)
    )  # images reached the engine
    out = tmp_path / "run"
    kill_mid_step_then_resume(
        [*driver_args(model_dir, train, out, reward_file), *VLM], out, reference, tmp_path, step=2
    )
