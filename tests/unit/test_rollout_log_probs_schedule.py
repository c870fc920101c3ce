"""When a training step asks the engine for its samples' log-probs (``actor_rollout_ref.rollout.calculate_log_probs``,
`fusedrl.trainer.step_plan.rollout_log_probs_wanted`), how a rollout without them looks, and the config's
checks of the key against what reads them."""

from __future__ import annotations

import pytest
import torch
from support import typed_run

from fusedrl.config import ConfigError, load_config
from fusedrl.trainer.step_plan import rollout_log_probs_wanted

HF = "actor_rollout_ref.rollout.name=hf"


def _steps(run, last: int = 31) -> list[int]:
    return [s for s in range(1, last + 1) if rollout_log_probs_wanted(run, s)]


def test_auto_asks_on_the_rollout_checks_steps_only():
    assert _steps(typed_run()) == [1, 2, 10, 20, 30]  # the default: steps 1, 2 and every 10th
    assert _steps(typed_run("trainer.rollout_check_freq=4"), 13) == [1, 2, 4, 8, 12]
    assert _steps(typed_run("trainer.rollout_check_freq=1"), 5) == [1, 2, 3, 4, 5]


def test_an_explicit_value_wins_and_the_rollout_correction_always_asks():
    assert _steps(typed_run("actor_rollout_ref.rollout.calculate_log_probs=true"), 5) == [1, 2, 3, 4, 5]
    assert _steps(typed_run("actor_rollout_ref.rollout.calculate_log_probs=false"), 5) == []
    for correction in (
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=geometric",
        "algorithm.rollout_correction.bypass_mode=true",
    ):
        assert _steps(typed_run(correction), 5) == [1, 2, 3, 4, 5], correction


def test_a_rollout_without_log_probs_has_none():
    from fusedrl.batch import RolloutBatch
    from fusedrl.workers.rollout.base import attach_responses

    def batch() -> RolloutBatch:
        return RolloutBatch.from_prompts(
            prompts=torch.tensor([[5, 6], [7, 8]]),
            prompt_mask=torch.ones(2, 2, dtype=torch.long),
            uid=["a", "b"],
            data_source=["t", "t"],
            ground_truth=["1", "2"],
        )

    samples = [([3, 4], [-0.5, -1.5]), ([9], [-0.25])]
    got = attach_responses(batch(), samples, max_response_length=3, pad_token_id=0)
    assert got.rollout_log_probs.tolist() == [[-0.5, -1.5, 0.0], [-0.25, 0.0, 0.0]]
    none = attach_responses(
        batch(), [(ids, []) for ids, _ in samples], max_response_length=3, pad_token_id=0, log_probs=False
    )
    assert none.rollout_log_probs is None
    assert none.responses.tolist() == got.responses.tolist() == [[3, 4, 0], [9, 0, 0]]
    assert none.response_mask.tolist() == [[1, 1, 0], [1, 0, 0]]


def test_a_turn_without_log_probs_keeps_the_trajectory_aligned():
    from fusedrl.agent.trajectory import Trajectory

    traj = Trajectory(index=0, prompt_ids=[1, 2], budget=8)
    traj.add_sampled([3, 4], [], "x")  # the turn asked for none
    traj.add_observation([5], [{"role": "user", "content": "y"}])
    assert traj.log_probs == [0.0, 0.0, 0.0] and len(traj.log_probs) == len(traj.response_ids)


@pytest.fixture
def base(tiny_model_dir, arithmetic_data) -> list[str]:
    return [f"data.train_files={arithmetic_data[0]}", f"actor_rollout_ref.model.path={tiny_model_dir}", HF]


def _problems(base: list[str], *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config([*base, *overrides])
    return info.value.problems


def test_the_keys_values_are_checked(base):
    (bad,) = _problems(base, "actor_rollout_ref.rollout.calculate_log_probs=sometimes")
    assert bad.startswith("`actor_rollout_ref.rollout.calculate_log_probs`='sometimes'") and "auto" in bad
    (freq,) = _problems(base, "trainer.rollout_check_freq=0")
    assert freq.startswith("`trainer.rollout_check_freq`=0") and ">= 1" in freq


def test_false_is_refused_where_something_reads_them(base):
    off = "actor_rollout_ref.rollout.calculate_log_probs=false"
    found = _problems(
        base, off, "trainer.rollout_check_tol=1e-3", "algorithm.rollout_correction.rollout_is=token"
    )
    assert len(found) == 2, found
    assert any("rollout_check_tol`=0.001" in p and "rollout_check_tol=null" in p for p in found)
    assert any("rollout_correction" in p and "calculate_log_probs=auto" in p for p in found)
    stale = _problems(base, off, "async_training.max_staleness=1")  # (and what async training itself needs)
    assert any(p.startswith(f"`{off.split('=')[0]}`=false with asynchronous training") for p in stale), stale
    # auto's check and no correction: nothing reads them, false is taken (the check is then off).
    load_config([*base, off])
