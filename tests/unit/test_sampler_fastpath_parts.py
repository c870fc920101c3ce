"""The parts of third_party/vllm/sampler_fastpath.py on vLLM's own sampler objects, without an engine.

The cheaper seed draw gives what vLLM's ``TopKTopPSampler.forward_cpu`` gives (tokens, processed log-probs and
every generator's state after) bit for bit; the eager rank count equals a hand count, split in row blocks
too; and the fast path is refused up front, with the reason, where vLLM is not the code it was read against.
"""

from __future__ import annotations

import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.v1.sample.sampler import Sampler  # noqa: E402

from fusedrl.third_party.vllm import sampler_fastpath as sf  # noqa: E402


def _generators(seeds: dict[int, int]) -> dict[int, torch.Generator]:
    return {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("top", [False, True])
def test_in_place_seed_draw_samples_as_vllm(mode, top):
    sampler = Sampler(logprobs_mode=mode)
    tk = sampler.topk_topp_sampler
    assert sf._seed_draw_unfit(sampler) is None
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(1))
    k = torch.tensor([20, 5, 300, 1, 50, 7, 300]) if top else None
    p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.99, 0.7, 1.0]) if top else None
    seeds = {0: 3, 2: 2**40 + 1, 3: 17, 5: 5, 6: 123456}  # rows 1 and 4: the global generator's draw
    results = []
    for forward in (tk.forward_cpu, sf._seeded_forward_cpu.__get__(tk)):
        gens = _generators(seeds)
        torch.manual_seed(9)
        tokens, returned = forward(logits.clone(), gens, k, p)
        states = {row: g.get_state() for row, g in gens.items()}
        results.append((tokens, returned, states, torch.get_rng_state()))
    (tok_a, ret_a, st_a, rng_a), (tok_b, ret_b, st_b, rng_b) = results
    assert torch.equal(tok_a, tok_b)
    assert (ret_a is None and ret_b is None) == (mode == "raw_logprobs")
    if ret_a is not None:
        assert torch.equal(ret_a, ret_b)
    assert all(torch.equal(st_a[row], st_b[row]) for row in seeds)
    assert torch.equal(rng_a, rng_b)
    # the seeded rows' generators were used (advanced from their seeds)
    assert any(
        not torch.equal(st_a[row], torch.Generator().manual_seed(s).get_state()) for row, s in seeds.items()
    )


def test_eager_rank_count_counts_by_hand(monkeypatch):
    x = torch.tensor([[0.1, 0.5, 0.5, -1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5], [-1.0], [0.0]])
    expected = torch.tensor([2, 4, 4])  # entries >= the row's value (ties count)
    assert torch.equal(sf._eager_rank_count(x, values), expected)
    monkeypatch.setattr(sf, "_RANK_BLOCK", 8)  # two rows of 4 a block: the split path
    assert torch.equal(sf._eager_rank_count(x, values), expected)
    big = torch.randn(37, 50)
    vals = big.gather(-1, torch.randint(0, 50, (37, 1)))
    monkeypatch.setattr(sf, "_RANK_BLOCK", 150)
    assert torch.equal(sf._eager_rank_count(big, vals), (big >= vals).sum(-1))
    assert sf._eager_rank_count(big, vals).dtype == torch.int64


def test_refused_up_front_where_vllm_differs(monkeypatch):
    holder = Sampler()
    tk = holder.topk_topp_sampler
    assert "fp64" in sf._seed_draw_unfit(Sampler(use_fp64_gumbel=True))
    native = types.SimpleNamespace(topk_topp_sampler=types.SimpleNamespace(forward=tk.forward_native))
    assert "not TopKTopPSampler.forward_cpu" in sf._seed_draw_unfit(native)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert "vLLM 0.33.0" in sf._seed_draw_unfit(holder)
    assert "vLLM 0.33.0" in sf._rank_count_unfit()
    monkeypatch.undo()
    other = types.SimpleNamespace(topk_topp_sampler=tk)  # a sampler without vLLM's ``sample``
    assert "the sampler's sample is None" in sf._seed_draw_unfit(other)
    from vllm.v1.sample import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "batched_count_greater_than", lambda x, values: None)
    assert "batched_count_greater_than is" in sf._rank_count_unfit()


@pytest.mark.parametrize("asked", [None, 0, "token_ids"])
def test_processed_logprobs_only_for_a_batch_that_reads_them(asked):
    """The fast path's ``sample`` tells the top-k/top-p sampler whether the batch reads log-probs: the same
    tokens and generator states as vLLM's own ``Sampler.sample``, and the processed log-probs (bit for bit)
    where a request asks for them, none where no request does (vLLM's ``forward`` would drop them)."""
    seeds = {0: 3, 2: 7, 4: 11}
    logits = torch.randn(5, 400, generator=torch.Generator().manual_seed(2))
    results = []
    for fast in (False, True):
        sampler = Sampler(logprobs_mode="processed_logprobs")
        if fast:
            tk = sampler.topk_topp_sampler
            tk.forward = sf._seeded_forward_cpu.__get__(tk)
            sampler.sample = sf._noting_sample.__get__(sampler)
        gens = _generators(seeds)
        meta = types.SimpleNamespace(
            all_random=True,
            all_greedy=False,
            temperature=torch.full((5,), 0.8),
            generators=gens,
            top_k=torch.tensor([20, 400, 5, 400, 50]),
            top_p=None,
            logitsprocs=types.SimpleNamespace(argmax_invariant=[]),
            max_num_logprobs=asked if asked != "token_ids" else None,
            logprob_token_ids={1: [5, 6]} if asked == "token_ids" else None,
        )
        torch.manual_seed(4)
        tokens, returned = sampler.sample(logits.clone(), meta)
        results.append((tokens, returned, {r: g.get_state() for r, g in gens.items()}, torch.get_rng_state()))
    (tok_a, ret_a, st_a, rng_a), (tok_b, ret_b, st_b, rng_b) = results
    assert torch.equal(tok_a, tok_b) and torch.equal(rng_a, rng_b)
    assert all(torch.equal(st_a[r], st_b[r]) for r in seeds)
    assert ret_a is not None and ret_a.shape == (5, 400)  # vLLM's own computes them every time
    if asked is None:
        assert ret_b is None
    else:
        assert torch.equal(ret_a, ret_b)
