"""Shared prompts in packed rows (`fusedrl.workers.packing.pack_shared_prompts`): rows with the same prompt
hold it once, and every number comes out as in the padded and the whole-row packed forwards.

The model is a tiny Qwen2 built on the spot with fusedrl's CPU attention. Rows of one prompt are scattered
through the batch (as balancing can leave them), one prompt has a single row, lengths differ per row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import padded_batch, spawned_result

import fusedrl.workers.cpu_attention as cpu_attention
from fusedrl.workers.logprob import response_log_probs
from fusedrl.workers.packing import attention_buckets, pack_batch, prompt_groups

TEMPERATURE = 0.7


def _model(attn: str | None = None, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,  # as the training roles set it (with a cache Transformers reads no packed rows)
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn or cpu_attention.register())


def _grouped_batch():
    """8 rows over 4 prompts: prompt 0 x3, 1 x2, 2 x2, 3 x1, in scattered order; own responses each."""
    gen = torch.Generator().manual_seed(1)
    base = padded_batch([5, 9, 3, 7], [6, 4, 8, 1], tp=10, tr=8, gen=gen)
    batch = base[torch.tensor([0, 1, 0, 2, 1, 0, 3, 2])]
    batch.responses = torch.randint(3, 400, batch.responses.shape, generator=gen)
    lengths = torch.tensor([6, 2, 3, 8, 4, 1, 1, 5])
    batch.response_mask = (torch.arange(8)[None] < lengths[:, None]).long()  # [B, Tr]
    return batch


def _log_probs_and_grads(model, batch, **kwargs):
    """Log-probs and entropy [B, Tr] (0 on padding) and every parameter's gradient of a weighted sum."""
    model.zero_grad()
    weights = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(5))
    lp, ent = response_log_probs(model, batch, temperature=TEMPERATURE, with_entropy=True, **kwargs)
    mask = batch.response_mask
    ((lp * weights * mask).sum() + 0.1 * (ent * mask).sum()).backward()
    return lp * mask, ent * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_layout_by_hand():
    """Two rows of the prompt [11, 12], responses [21] and [31, 32]: the row is p p a b b, and every
    index is the one worked out by hand."""
    from fusedrl.batch import RolloutBatch

    batch = RolloutBatch(
        prompts=torch.tensor([[0, 11, 12], [0, 11, 12]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1]]),
        responses=torch.tensor([[21, 0], [31, 32]]),
        response_mask=torch.tensor([[1, 0], [1, 1]]),
        batch_size=[2],
    )
    packed = pack_batch(batch, share_prompts=True)
    assert packed.input_ids.tolist() == [[11, 12, 21, 31, 32]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 3]]  # both responses continue at the prompt's end
    assert packed.pred_index.tolist() == [1, 1, 3]  # 21 and 31 from the last prompt token, 32 from 31
    assert packed.targets.tolist() == [21, 31, 32]
    ((src, dst, tokens),) = packed.model_kwargs[cpu_attention.SHARED_LAYOUT_KWARG]  # one attention call
    assert src.tolist() == [[0, 1, 2, 2], [0, 1, 3, 4]]  # each sample's whole sequence; padding repeats
    # prompt tokens read the first sample's slots 0, 1; 21 its slot 2; 31 and 32 the second's slots 2, 3
    assert dst.tolist() == [0, 1, 2, 6, 7]
    assert tokens.tolist() == [0, 1, 2, 3, 4]
    assert prompt_groups(batch) == [[0, 1]]


def test_layout_by_hand_interleaved_groups_and_an_empty_response():
    """A group whose rows are not adjacent (rows 0 and 2 share [11, 12]), a row with no response, prompts of
    different lengths: every index of the row and its one attention call, worked out by hand."""
    from fusedrl.batch import RolloutBatch

    batch = RolloutBatch(
        prompts=torch.tensor([[0, 11, 12], [13, 14, 15], [0, 11, 12]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]]),
        responses=torch.tensor([[21, 0], [41, 42], [0, 0]]),
        response_mask=torch.tensor([[1, 0], [1, 1], [0, 0]]),
        batch_size=[3],
    )
    assert prompt_groups(batch) == [[0, 2], [1]]
    packed = pack_batch(batch, share_prompts=True)
    assert packed.input_ids.tolist() == [[11, 12, 21, 13, 14, 15, 41, 42]]  # group [0, 2], then group [1]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert packed.pred_index.tolist() == [1, 5, 6]  # 21 from 12, 41 from 15, 42 from 41
    assert packed.targets.tolist() == [21, 41, 42]
    ((src, dst, tokens),) = packed.model_kwargs[cpu_attention.SHARED_LAYOUT_KWARG]
    # samples shortest first: row 2 (its prompt only), row 0, row 1; padding repeats the last token
    assert src.tolist() == [[0, 1, 1, 1, 1], [0, 1, 2, 2, 2], [3, 4, 5, 6, 7]]
    assert dst.tolist() == [5, 6, 7, 10, 11, 12, 13, 14]  # the shared prompt reads row 0's slots
    assert tokens.tolist() == list(range(8))


def test_fewer_tokens_and_the_padded_numbers():
    """Log-probs, entropy and every gradient equal the padded forward's and the whole-row packing's."""
    model, batch = _model(), _grouped_batch()
    shared = pack_batch(batch, share_prompts=True)
    whole = pack_batch(batch)
    distinct = 5 + 9 + 3 + 7  # each prompt once
    assert shared.input_ids.shape[1] == distinct + int(batch.response_mask.sum())
    assert whole.input_ids.shape[1] == int(batch.prompt_mask.sum() + batch.response_mask.sum())
    assert prompt_groups(batch) == [[0, 2, 5], [1, 4], [3, 7], [6]]
    padded = _log_probs_and_grads(model, batch)
    packed = _log_probs_and_grads(model, batch, remove_padding=True)
    for got in (_log_probs_and_grads(model, batch, remove_padding=True, share_prompts=True), packed):
        torch.testing.assert_close(got[0], padded[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], padded[1], rtol=1e-5, atol=1e-5)
        for name, grad in got[2].items():
            rel = (grad - padded[2][name]).norm() / padded[2][name].norm()
            assert rel < 1e-5, (name, float(rel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_row_in_each_dtype(dtype):
    """The shared row's layout has one attention row per sample and one output slot per packed token; its
    log-probs equal the whole rows' (in bf16 the attention runs as matmuls: to bf16 precision)."""
    model, batch = _model().to(dtype), _grouped_batch()
    shared = pack_batch(batch, share_prompts=True)
    ((src, dst, _),) = shared.model_kwargs[cpu_attention.SHARED_LAYOUT_KWARG]
    assert shared.input_ids.shape[1] == 24 + int(batch.response_mask.sum())
    assert src.shape[0] == batch.num_samples
    assert dst.shape[0] == shared.input_ids.shape[1]
    with torch.no_grad():
        logits = shared.response_logits(model).float() / TEMPERATURE
        got = shared.unpack(torch.log_softmax(logits, -1).gather(-1, shared.targets[:, None])[:, 0])
        want, _ = response_log_probs(model, batch, temperature=TEMPERATURE, remove_padding=True)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got, want.float() * batch.response_mask, rtol=tol, atol=tol)


def test_attention_buckets_by_hand():
    """Padded calls cost samples x longest^2 pairs plus a fixed cost: a long tail gets a call of its own."""
    # one call: 4 x 512^2 = 1.05M pairs; two: 3 x 64^2 + 512^2 + 2 x 4096 = 282k
    assert attention_buckets([60, 512, 60, 64]) == [[0, 2, 3], [1]]
    assert attention_buckets([60, 61, 64, 62]) == [[0, 1, 3, 2]]  # similar lengths: one call, shortest first
    assert attention_buckets([10, 20], call_cost=0) == [[0], [1]]  # 100 + 400 < 2 x 400
    assert attention_buckets([10, 20], call_cost=301) == [[0, 1]]  # 800 < 500 + 2 x 301
    assert attention_buckets([7]) == [[0]]


def _long_tail_batch():
    """6 rows over 2 prompts, one response of 150 tokens among responses of 2-9: the tail gets its own call."""
    gen = torch.Generator().manual_seed(3)
    batch = padded_batch([6, 11], [1, 1], tp=12, tr=160, gen=gen)[torch.tensor([0, 1, 0, 1, 0, 1])]
    batch.responses = torch.randint(3, 400, batch.responses.shape, generator=gen)
    lengths = torch.tensor([4, 9, 150, 2, 7, 5])
    batch.response_mask = (torch.arange(160)[None] < lengths[:, None]).long()  # [B, Tr]
    return batch


def test_a_long_tail_in_its_own_call_gives_the_same_numbers():
    """Log-probs, entropy and gradients of a row split into two attention calls equal the one-call row's and
    the whole-row packing's (the calls are independent: each sample's attention sees only its own row)."""
    model, batch = _model(), _long_tail_batch()
    calls = pack_batch(batch, share_prompts=True).model_kwargs[cpu_attention.SHARED_LAYOUT_KWARG]
    assert [src.shape for src, _, _ in calls] == [torch.Size([5, 20]), torch.Size([1, 156])]
    one = pack_batch(batch, layout=True, share_prompts=True).model_kwargs[cpu_attention.SHARED_LAYOUT_KWARG]
    assert [src.shape for src, _, _ in one] == [torch.Size([6, 156])]  # compiled layers: one call
    split = _log_probs_and_grads(model, batch, remove_padding=True, share_prompts=True)
    whole = _log_probs_and_grads(model, batch, remove_padding=True)
    for got, want in zip(split[:2], whole[:2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in split[2].items():
        rel = (grad - whole[2][name]).norm() / whole[2][name].norm()
        assert rel < 1e-5, (name, float(rel))


def test_other_attention_packs_whole_rows():
    """With Transformers' SDPA, which reads sequence boundaries from the positions, the rows are packed
    whole (sharing needs fusedrl's attention): the numbers stay the padded forward's."""
    model, batch = _model("sdpa"), _grouped_batch()
    padded = _log_probs_and_grads(model, batch)
    got = _log_probs_and_grads(model, batch, remove_padding=True, share_prompts=True)
    torch.testing.assert_close(got[0], padded[0], rtol=1e-5, atol=1e-5)


def test_a_call_that_cannot_share_says_which_key():
    q = k = v = torch.zeros(1, 2, 5, 4)
    layout = ((torch.zeros(2, 4, dtype=torch.long), torch.zeros(5, dtype=torch.long), torch.arange(5)),)
    with pytest.raises(ValueError, match="share_prompt_prefix=false"):
        cpu_attention.attention(
            torch.nn.Module(), q, k, v, None, dropout=0.1, **{cpu_attention.SHARED_LAYOUT_KWARG: layout}
        )


def _two_updates(port: int, model_dir: str, out: str) -> None:
    """One rank of FSDP2 over gloo: the actor's update on the grouped batch, with and without sharing."""
    from support import single_rank_group

    from fusedrl.config import role_configs_from_overrides
    from fusedrl.workers.actor import ActorRole
    from fusedrl.workers.packing import can_share_prompts

    results = {}
    with single_rank_group(port):
        for share in (True, False):
            cfg = role_configs_from_overrides(
                [
                    "data.train_files=unused",
                    f"actor_rollout_ref.model.path={model_dir}",
                    "actor_rollout_ref.rollout.n=2",
                    "actor_rollout_ref.rollout.dtype=float32",
                    "actor_rollout_ref.actor.fsdp_config.param_dtype=null",  # float32: the tolerances assume it
                    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                    "actor_rollout_ref.actor.optim.lr=1e-3",
                    "actor_rollout_ref.actor.use_kl_loss=true",
                    "actor_rollout_ref.model.use_remove_padding=true",
                    f"actor_rollout_ref.model.share_prompt_prefix={str(share).lower()}",
                ]
            )
            actor = ActorRole(cfg.model, cfg.actor, rollout_n=2)
            assert can_share_prompts(actor.model)  # fusedrl's attention: sharing can run
            batch = _grouped_batch()
            batch.advantages = torch.linspace(-1, 1, 8)[:, None] * batch.response_mask  # [B, Tr]
            old = actor.compute_log_prob(batch, temperature=TEMPERATURE, micro_batch_size=8)
            batch.old_log_probs = old
            batch.ref_log_probs = old - 0.05 * batch.response_mask
            before = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
            metrics = actor.update(batch, temperature=TEMPERATURE)
            params = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
            results[share] = {"old": old, "metrics": metrics, "params": params, "before": before}
            del actor
    torch.save(results, out)


def test_actor_update_with_shared_prompts_equals_unshared(tiny_model_dir, tmp_path: Path):
    """Real FSDP2 roles: old log-probs and the parameters after one update agree with sharing off."""
    results = spawned_result(_two_updates, tiny_model_dir, tmp_path, timeout=300)
    shared, whole = results[True], results[False]
    torch.testing.assert_close(shared["old"], whole["old"], rtol=1e-5, atol=1e-5)
    # AdamW's first step moves each parameter by ~lr * g / (|g| + eps): float noise in a gradient element
    # near eps moves it by a part of lr (seen: 1.3e-3 lr on an AMX Xeon, 1.6e-2 lr on an AVX-512 EPYC), so
    # the update is compared as a whole; a packing bug moves most elements by ~lr.
    lr = 1e-3
    names = list(shared["params"])
    step = torch.cat([(whole["params"][n] - shared["before"][n]).flatten() for n in names])
    gap = torch.cat([(shared["params"][n] - whole["params"][n]).flatten() for n in names])
    assert float(gap.norm() / step.norm()) < 1e-3
    assert int((gap.abs() > 1e-2 * lr).sum()) <= max(1, gap.numel() // 10_000)
    assert any(not torch.equal(p, shared["before"][n]) for n, p in shared["params"].items())  # it trained
    norm = shared["metrics"]["actor/grad_norm"]
    assert norm > 0 and abs(norm - whole["metrics"]["actor/grad_norm"]) <= 1e-4 * norm


def test_token_budget_micro_batches_hold_whole_groups():
    """Dynamic batch size with shared prompts: micro-batches hold whole prompt groups, each counted at
    its packed size (the prompt once), so fewer micro-batches fit the same budget."""
    from fusedrl.workers.logprob import split_micro_batches

    batch = _grouped_batch()
    # groups (rows): [0, 2, 5] 5 + 6+3+1 = 15 packed tokens, [1, 4] 9 + 2+4 = 15, [3, 7] 3 + 8+5 = 16,
    # [6] 7 + 1 = 8: 54 in all, 3 micro-batches of <= 24 (16 | 15 + 8 | 15); whole rows (76 tokens)
    # need 4 or more.
    mbs, order = split_micro_batches(batch, rows=1, max_token_len=24, share_prompts=True)
    assert len(mbs) == 3
    assert sorted(order.tolist()) == list(range(8))
    groups = [{0, 2, 5}, {1, 4}, {3, 7}, {6}]
    start = 0
    for mb in mbs:
        rows = set(order[start : start + mb.num_samples].tolist())
        start += mb.num_samples
        assert all(g <= rows or not (g & rows) for g in groups), rows  # no group split
        assert pack_batch(mb, share_prompts=True).input_ids.shape[1] <= 24
    assert len(split_micro_batches(batch, rows=1, max_token_len=24)[0]) >= 4
    # A group over the budget on its own: row by row, as without sharing.
    assert len(split_micro_batches(batch, rows=1, max_token_len=14, share_prompts=True)[0]) == len(
        split_micro_batches(batch, rows=1, max_token_len=14)[0]
    )
