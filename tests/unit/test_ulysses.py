"""Ulysses sequence parallelism (`fusedrl.workers.ulysses`): sp=2 gives sp=1's log-probs, entropy and
gradients.

Two spawned processes join a real gloo process group (pytest's own process never joins one). Both load
the tiny Qwen2 model (4 query heads, 2 key/value heads) in float32 from the same folder and take the same
8-row batch (sequences of 2 to 28 tokens, 101 real tokens: packed and padded to 102, 51 per rank). Each
computes its half of the tokens; attention heads are exchanged by all-to-all. The same loss (a weighted
sum of log-probs and entropies) is backpropagated on both ranks and the parameter gradients are summed
over the group. Rank 0 also runs the whole batch alone (the packed sp=1 path of
`fusedrl.workers.logprob.response_log_probs`) as the reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, padded_batch

TP, TR = 16, 12
PROMPT_LENS = [16, 1, 9, 3, 12, 2, 5, 7]
RESPONSE_LENS = [12, 1, 3, 12, 6, 2, 9, 1]
# Both paths run the same float32 ops on the same tokens; only the matmul shapes differ (51 vs 102 rows per
# projection, 2 heads per attention call vs 4), so CPU kernels may sum in another order. Float32's unit
# roundoff is u = 6e-8; a log-prob is a log-sum-exp over a vocabulary of ~400 logits that are themselves
# sums over hidden 32 through 2 layers: relative error ~ sqrt(n) u per sum, compounded over ~20 ops, about
# 1e-6 of values of size ~6 (seen: bit-equal on one AVX-512 CPU). Log-probs and entropy: atol 2e-5. Gradients sum ~100
# tokens' contributions more: 1e-4 of the largest gradient entry (seen: 5e-7). An sp bug (a token attending the wrong
# slice, a head sent to the wrong rank, a gradient dropped) moves values by > 1e-2 (the control below).
ATOL = 2e-5
GRAD_RTOL = 1e-4


def _batch():
    gen = torch.Generator().manual_seed(5)
    return padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=TP, tr=TR, gen=gen)


def _weights(batch):
    gen = torch.Generator().manual_seed(6)
    return torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask  # [B, Tr]


def _model(model_dir: str):
    from fusedrl.workers.fsdp import load_causal_lm

    return load_causal_lm(model_dir, "float32", "sdpa")  # as the roles load it (no KV cache)


def _loss_and_grads(model, log_probs, entropy, w):
    loss = (log_probs * w).sum() + 0.5 * (entropy * w.abs()).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _run(rank: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.workers.logprob import response_log_probs
    from fusedrl.workers.packing import pack_batch
    from fusedrl.workers.ulysses import slice_packed, ulysses_response_log_probs

    batch, group = _batch(), dist.group.WORLD
    w = _weights(batch)
    model = _model(model_dir)
    results: dict = {}
    lp, ent = ulysses_response_log_probs(model, batch, group, temperature=0.7, with_entropy=True)
    assert ent is not None
    grads = _loss_and_grads(model, lp, ent, w)
    for g in grads.values():
        dist.all_reduce(g)  # each rank's gradients cover its own tokens: the group's sum is the gradient
    results["sp2"] = {"log_probs": lp.detach(), "entropy": ent.detach(), "grads": grads}
    packed = pack_batch(batch)
    results["tokens"] = packed.input_ids.shape[1]
    results["slice"] = slice_packed(packed.input_ids, packed.position_ids, 2, rank).input_ids.shape[1]
    if rank == 0:
        lp1, ent1 = response_log_probs(model, batch, temperature=0.7, with_entropy=True, remove_padding=True)
        assert ent1 is not None
        results["sp1"] = {
            "log_probs": lp1.detach(),
            "entropy": ent1.detach(),
            "grads": _loss_and_grads(model, lp1, ent1, w),
        }
        # Control: rank 1's slice (tokens 51..101) alone, attention limited to it (no exchange): the
        # sequence that straddles the cut loses its beginning, so the check can fail.
        piece = slice_packed(packed.input_ids, packed.position_ids, 2, 1)
        with torch.no_grad():
            logits = model(input_ids=piece.input_ids, position_ids=piece.position_ids).logits[0]  # [51, V]
        local = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, piece.next_ids[0, :, None])[:, 0]
        ref_next = torch.log_softmax(
            model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0].detach() / 0.7, -1
        )
        full_next = ref_next.gather(
            -1, torch.cat([packed.input_ids[0, 1:], packed.input_ids[0, :1]])[:, None]
        )
        results["control_gap"] = float((local[:49] - full_next[51:100, 0]).abs().max())  # real tokens
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _entry(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _run(rank, model_dir, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ulysses")
    mp.spawn(_entry, args=(2, free_port(), tiny_model_dir, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_the_sequence_is_split_in_half(ranks):
    assert ranks[0]["tokens"] == sum(PROMPT_LENS) + sum(RESPONSE_LENS) == 101
    assert ranks[0]["slice"] == ranks[1]["slice"] == 51  # padded to 102


def test_sp2_log_probs_and_entropy_equal_sp1(ranks):
    mask = _batch().response_mask.bool()
    ref = ranks[0]["sp1"]
    assert ref["log_probs"][mask].abs().min() > 1e-3  # real numbers, not zeros on both sides
    for rank in ranks:
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(rank["sp2"][key], ref[key], atol=ATOL, rtol=0)
            assert torch.all(rank["sp2"][key][~mask] == 0)
    # The comparison can fail: attention limited to one rank's slice gives other numbers.
    assert ranks[0]["control_gap"] > 1e-2


def test_sp2_gradients_equal_sp1(ranks):
    ref = ranks[0]["sp1"]["grads"]
    for rank in ranks:
        grads = rank["sp2"]["grads"]
        assert grads.keys() == ref.keys()
        for name, g in ref.items():
            scale = float(g.abs().max())
            assert scale > 0, name  # every parameter gets a gradient
            err = float((grads[name] - g).abs().max())
            assert err <= GRAD_RTOL * scale, (name, err, scale)
