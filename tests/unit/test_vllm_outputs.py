"""Reading the sampled tokens' log-probs from vLLM's flat container and from its per-position dicts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fusedrl.third_party.vllm.outputs import completion, sampled_logprobs

logprobs_mod = pytest.importorskip("vllm.logprobs")


def _flat(rows):
    flat = logprobs_mod.FlatLogprobs()
    for row in rows:  # row: [(token_id, logprob, rank), ...], the sampled token first
        tokens, values, ranks = zip(*row)
        flat.append_fast(list(tokens), list(values), iter(ranks), [None] * len(row))
    return flat


def _dicts(rows):
    return [{t: logprobs_mod.Logprob(logprob=v, rank=r) for t, v, r in row} for row in rows]


def test_flat_and_dict_containers_give_the_same_floats():
    ids = [5, 9, 5]
    rows = [[(5, -0.25, 2)], [(9, -1.5, 1)], [(5, -3.125, 7)]]
    assert sampled_logprobs(ids, _flat(rows)) == [-0.25, -1.5, -3.125]
    assert sampled_logprobs(ids, _dicts(rows)) == [-0.25, -1.5, -3.125]


def test_a_flat_container_with_extra_entries_reads_each_positions_sampled_token():
    # logprobs > 0 would put the top-k after the sampled token: the fast path must not take them
    ids = [5, 9]
    rows = [[(5, -0.25, 2), (7, -0.1, 1)], [(9, -1.5, 1)]]
    assert sampled_logprobs(ids, _flat(rows)) == [-0.25, -1.5]


def test_completion_refuses_missing_log_probs_and_names_the_finish_reason():
    flat = _flat([[(5, -0.25, 1)], [(9, -1.5, 1)]])
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 9], logprobs=flat, finish_reason="length")])
    assert completion(out) == ([5, 9], [-0.25, -1.5], "length")
    out.outputs[0].finish_reason = "stop"
    assert completion(out)[2] == "stop"
    out.outputs[0].logprobs = _flat([[(5, -0.25, 1)]])  # asked for (a container), one short
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        completion(out)
    out.outputs[0].logprobs = None  # not asked for (SampleParams.log_probs=False): none, no error
    assert completion(out) == ([5, 9], [], "stop")
