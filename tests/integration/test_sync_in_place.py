"""The in-place weight sync (`RoleGroups.sync_in_place`, `WorkerDict.sync_engine`): one call where the engines
live in the actor's workers, none right after such a sync when no call has reached the workers since.

One fused worker, the fake engine, GRPO: after a step's sync the next rollout's `sync_weights` sends nothing;
any call in between makes it ask again (the engine's phase counts the skip); ``force`` streams anyway; an
engine made stale (a restored checkpoint) is streamed before it samples.
"""

from __future__ import annotations

import pytest
from support import fake_engine_grpo, started_trainer

pytestmark = pytest.mark.integration


def test_in_place_sync_is_one_call_or_none(tiny_model_dir, arithmetic_data, tmp_path):
    with started_trainer(fake_engine_grpo(tiny_model_dir, arithmetic_data[0], tmp_path)) as trainer:
        group = trainer.workers
        trainer.global_step = 1
        m = trainer.train_step()
        assert m["sync/streamed"] == 1.0
        calls = group.calls
        assert trainer.sync_weights() == {"sync/streamed": 0.0}
        assert group.calls == calls  # nothing sent: the engine got the weights at the last call's sync
        assert trainer.sync_weights() == {"sync/streamed": 0.0} and group.calls == calls
        (before,) = group.run_all(lambda w: w.rollout_phase.remote())  # a call: the driver asks again
        assert before["needs_stream"] is False
        assert trainer.sync_weights() == {"sync/streamed": 0.0}
        (after,) = group.run_all(lambda w: w.rollout_phase.remote())
        assert after["skipped"] == before["skipped"] + 1 and after["streams"] == before["streams"]
        forced = trainer.sync_weights(force=True)
        assert forced["sync/streamed"] == 1.0 and "timing_s/sync_weights_inner" in forced
        (after_force,) = group.run_all(lambda w: w.rollout_phase.remote())
        assert after_force["streams"] == after["streams"] + 1
        # A restored checkpoint makes the engine stale: it is streamed before the next rollout samples.
        trainer.save_checkpoint()
        assert trainer.load_checkpoint() is not None
        trainer.global_step = 2
        trainer.train_step()
        (last,) = group.run_all(lambda w: w.rollout_phase.remote())
        assert last["streams"] == after_force["streams"] + 2  # before the rollout, and after the update
        assert last["needs_stream"] is False
