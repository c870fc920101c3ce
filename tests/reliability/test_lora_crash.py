"""A LoRA run SIGKILLed in the middle of a step resumes from its last checkpoint (adapters and their AdamW
state only) and equals an uninterrupted LoRA run: the same logged metrics at every step and the same final
checkpoint within float32 tolerance. The engine is re-fed after the resume (its weights come from the base
model), so a resume that forgot the adapters' merged stream would change the samples and the metrics."""

from __future__ import annotations

import pytest
from driver_runs import driver_args, kill_mid_step_then_resume, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")
pytest.importorskip("peft")

LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
    "actor_rollout_ref.actor.optim.lr=1e-2",  # adapters move visibly in 4 steps of the tiny model
]


def test_lora_sigkill_mid_step_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, tmp_path
):
    reference = tmp_path / "reference"
    run_to_end(
        [*driver_args(tiny_model_dir, arithmetic_data[0], reference, reward_file), *LORA],
        tmp_path / "reference.log",
    )
    out = tmp_path / "run"
    args = [*driver_args(tiny_model_dir, arithmetic_data[0], out, reward_file), *LORA]
    # Killed inside step 3 after the adapters' update, before the engine's sync.
    kill_mid_step_then_resume(args, out, reference, tmp_path)
