"""A multi-turn agentic run (environment rollouts through the in-process engine, deterministic environment)
SIGKILLed in the middle of a step resumes from its last checkpoint and equals an uninterrupted multi-turn run:
the same logged metrics at every step (turns, observation tokens and environment rewards included) and the
same final checkpoint within float32 tolerance. Each turn's sampling seed derives from the row's seed and the
turn index, so the resumed run samples the same tokens as the uninterrupted one."""

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

PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agent_plugins.py")
MULTI_TURN = {
    "data.max_response_length": "96",
    "algorithm.custom_modules": f"[{PLUGIN}]",
    "actor_rollout_ref.rollout.multi_turn.enable": "true",
    "actor_rollout_ref.rollout.multi_turn.default_agent_name": "plugin_count_env",
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": "12",
}


def _args(model_dir, train_file, out, reward_file) -> list[str]:
    base = driver_args(model_dir, train_file, out, reward_file)
    kept = [a for a in base if a.split("=", 1)[0] not in MULTI_TURN]
    return [*kept, *(f"{key}={value}" for key, value in MULTI_TURN.items())]


def test_agentic_sigkill_mid_step_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, tmp_path
):
    reference = tmp_path / "reference"
    run_to_end(_args(tiny_model_dir, arithmetic_data[0], reference, reward_file), tmp_path / "ref.log")
    turns = [m["agent/assistant_turns/mean"] for m in metrics(reference)]
    assert turns == [3.0] * 4, turns  # really multi-turn: the environment asks twice, then ends
    assert all(m["agent/observation_tokens/mean"] > 0 for m in metrics(reference))
    out = tmp_path / "run"
    args = _args(tiny_model_dir, arithmetic_data[0], out, reward_file)
    kill_mid_step_then_resume(args, out, reference, tmp_path)
