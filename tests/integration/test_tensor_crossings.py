"""Tensors that cross Ray between the driver and the workers in one GRPO step (issue 39, item 3).

`WorkerGroup.traffic` counts one crossing per tensor field per call, either way (a field sent to every rank of
one call is one crossing); `RoleGroups.tensor_crossings` sums the groups. The step here is GRPO with a
reference (KL loss) on the fake engine, sleeping at level 2 after each rollout, with the update's own forward
giving the old log-probs (one mini-batch). The count is what the driver moves today, phase by phase; the
issue's target is <= 3.
"""

from __future__ import annotations

import pytest
from support import fake_engine_grpo, started_trainer

pytestmark = pytest.mark.integration

# The crossings of that step, by worker call (docs/architecture.md, "Tensor crossings per step"): the
# rollout answers responses, response_mask and rollout_log_probs only (its answer echoed the request's
# prompts, prompt_mask and sample_seeds too before `rollout_generate_fields`: 21). The generated rows stay on
# the worker that made them (`fusedrl.resident`), so the reference reads its model inputs there and keeps
# its log-probs there (4 out and 1 back before: 18), and the update gets only the advantages (6 before).
# The request crosses as one ragged tensor (`fusedrl.rollout_request`: the prompts with their mask; the
# workers make the seeds) and the responses come back with their mask as one (3 out, 3 back before).
# The rollout's log-probs stay on the worker too (`step_plan.rollout_log_probs_stay`), and the update's old
# log-probs with them: it answers their gap, the step's `rollout/log_prob_abs_diff_*`, as numbers
# (`fusedrl.log_prob_gap`; 1 back before, and the rollout 1 more); the advantages cross as [B].
EXPECTED = {
    "rollout_generate_fields out": 1,
    "rollout_generate_fields back": 1,
    "actor_update_old_from_forward out": 1,  # the advantages, one number per row: [B]
}


def test_tensor_crossings_per_grpo_step(tiny_model_dir, arithmetic_data, tmp_path):
    overrides = fake_engine_grpo(tiny_model_dir, arithmetic_data[0], tmp_path)
    with started_trainer(overrides) as trainer:
        per_step = []
        for trainer.global_step in (1, 2):
            before = trainer.groups.tensor_crossings()
            calls_before = dict(trainer.workers.traffic.by_call)
            metrics = trainer.train_step()
            per_step.append(trainer.groups.tensor_crossings() - before)
            (phase,) = trainer.workers.run_all(lambda w: w.rollout_phase.remote())
            # The worker's phase decides the streams: the sync after the update left the engine current.
            assert not phase["needs_stream"] and metrics["sync/streamed"] == 1.0
        traffic = trainer.workers.traffic
        step2 = {k: v - calls_before.get(k, 0) for k, v in traffic.by_call.items()}
    assert metrics["actor/old_log_prob_from_update"] == 1.0
    assert 0.0 <= metrics["rollout/log_prob_abs_diff_mean"] <= metrics["rollout/log_prob_abs_diff_max"] < 1e-3
    # Step 1 re-streams first (the engine slept once built): weight streams move no tensor through the driver.
    assert per_step == [sum(EXPECTED.values())] * 2, per_step  # 8
    assert {k: v for k, v in step2.items() if v} == EXPECTED
    assert traffic.bytes > 0
    assert traffic.storage_bytes == traffic.bytes  # no call sends or answers a slice of a larger tensor
    # Each step: the engine slept at level 2, the update found its weights discarded, the sync restored them.
    assert phase["moves"][-3:] == [
        "sleep -> asleep, weights discarded",
        "wake -> awake, weights discarded",
        "stream -> awake, weights current",
    ], phase
