"""Seeded requests whose prompts exceed one iteration's token budget (vLLM-cpu, third_party/vllm/engine.py).

vLLM splits a prompt over iterations when a step's prefills exceed ``max_num_batched_tokens`` (chunked
prefill) and throws away the token sampled after a partial prefill, rewinding that request's generator by an
offset. A CPU generator has no offset: vLLM-cpu crashed there ("CPU Generator does not use offset") on any
seeded request split so, and fusedrl seeds every request. Partial rollout resubmits every paused request at
once (thousands of tokens), and a verl batch of 128 rows x 512 prompt tokens is 64k tokens an engine: both
went past the default budget. On CPU the engine prefills whole prompts (`engine_kwargs`).

Runs in a spawned process: the engine joins (and on teardown destroys) that process's process group.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import spawned_result, tiny_vllm_engine

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

ROWS, PROMPT, BUDGET = 8, 120, 256  # 960 prompt tokens against a budget of 256 a step


def _body(port: int, model_dir: str, out: str) -> None:
    from fusedrl.sampling import SampleParams

    engine = tiny_vllm_engine(
        port,
        model_dir,
        max_model_len=PROMPT + 8,
        max_num_batched_tokens=BUDGET,
        enable_chunked_prefill=True,  # verl's default: not honoured on CPU
        enforce_eager=True,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (PROMPT,), generator=g).tolist() for _ in range(ROWS)]
    params = SampleParams(max_tokens=4, temperature=1.0)
    seeds = [11 * r + 5 for r in range(ROWS)]
    together = engine.generate(prompts, params, seeds=seeds)
    alone = [engine.generate([p], params, seeds=[s])[0] for p, s in zip(prompts, seeds)]
    sched = engine.llm.llm_engine.vllm_config.scheduler_config
    torch.save(
        {
            "together": together,
            "alone": alone,
            "chunked": bool(sched.enable_chunked_prefill),
            "budget": int(sched.max_num_batched_tokens),
        },
        out,
    )
    os._exit(0)  # skip the engine's teardown (it destroys the process group) and vLLM's atexit hooks


def test_seeded_prompts_over_the_step_budget_sample_as_alone(tiny_model_dir, tmp_path):
    r = spawned_result(_body, tiny_model_dir, tmp_path, 600)
    assert not r["chunked"] and r["budget"] == BUDGET
    # Every request was prefilled whole, some in later iterations than others; a seed alone decides the tokens.
    assert [ids for ids, _ in r["together"]] == [ids for ids, _ in r["alone"]]
    for (_, lp_together), (_, lp_alone) in zip(r["together"], r["alone"]):
        assert torch.allclose(torch.tensor(lp_together), torch.tensor(lp_alone), atol=1e-5)
