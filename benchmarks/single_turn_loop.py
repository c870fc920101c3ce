"""Single-turn generation as the one-turn agent loop vs one batch ``engine.generate`` call, on one engine.

`fusedrl.workers.rollout.base.EngineRollout.generate` runs single-turn generation as
`fusedrl.agent.SingleTurnLoop` on the engine's request queue. This script builds one engine (``vllm`` or
``fake``) on the tiny model the way the fused worker does, and alternates the two paths on the same batch and
seeds: the loop (``rollout.generate``) and the former path (``engine.generate(prompts, params, seeds)``, then
`attach_responses`). It checks that every round's responses, masks and log-probs are equal bit for bit and
reports the median wall time and CPU time (this process's, ``time.process_time``: what the path itself
costs, far less sensitive than the wall time to other processes on a shared machine) of each path,
alternated so a machine's load falls on both alike.

    python -m benchmarks.single_turn_loop [--engine vllm] [--rows 64] [--max-tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def tiny_engine(engine_name: str, rows: int, max_tokens: int, port: int) -> tuple:
    """One in-process engine (``engine_name``, float32) on the tiny model in a one-rank gloo group on
    ``port``, and a batch of ``rows`` left-padded prompts for it: ``(rollout, batch, ctx)``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from benchmarks.common import model_dir
    from benchmarks.rollout_throughput import _prompt_ids
    from fusedrl.batch import RolloutBatch
    from fusedrl.config import role_configs_from_overrides
    from fusedrl.plugins import load_function
    from fusedrl.workers.rollout.base import EngineContext
    from fusedrl.workers.rollout.registry import engine_spec

    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.update(dict(engine_spec(engine_name).traits.worker_env))
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = model_dir("tiny")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompt_ids(tok, rows)
    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={path}",
            f"actor_rollout_ref.rollout.name={engine_name}",
            "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.cpu_kv_cache_gb=0.25",
        ]
    )
    width = max(map(len, prompts))
    ctx = EngineContext(
        cfg=cfg.rollout,
        model_path=path,
        seed=0,
        max_model_len=width + max_tokens,
        max_response_length=max_tokens,
        eos_token_id=int(tok.eos_token_id),
        pad_token_id=int(tok.pad_token_id or 0),
    )
    rollout = load_function(engine_spec(engine_name).build)(ctx)
    batch = RolloutBatch(
        prompts=torch.tensor([[0] * (width - len(p)) + p for p in prompts]),  # [B, Tp] left-padded
        prompt_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),  # [B, Tp]
        batch_size=[rows],
    )
    return rollout, batch, ctx


def measure(engine_name: str, rows: int, max_tokens: int, rounds: int) -> dict:
    import torch

    from fusedrl.workers.rollout.base import SamplingConfig, attach_responses, sample_params, unpadded_prompts

    rollout, batch, ctx = tiny_engine(engine_name, rows, max_tokens, port=29613)
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0)
    params = sample_params(sampling, stop_token_id=ctx.eos_token_id)
    times: dict[str, list[float]] = {"loop": [], "batch_generate": []}
    cpu: dict[str, list[float]] = {"loop": [], "batch_generate": []}
    equal, tokens = [], 0
    for k in range(rounds + 1):  # round 0 warms both paths up and is not timed
        seeds = torch.arange(rows, dtype=torch.long) * 7919 + 1000 * k
        b = batch.clone()
        b.sample_seeds = seeds
        order = ("loop", "batch_generate") if k % 2 == 0 else ("batch_generate", "loop")
        out = {}
        for path_name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            if path_name == "loop":
                out[path_name] = rollout.generate(b.clone(), sampling)
            else:
                samples = rollout.engine.generate(unpadded_prompts(b), params, seeds.tolist())
                out[path_name] = attach_responses(
                    b.clone(), samples, max_response_length=max_tokens, pad_token_id=ctx.pad_token_id
                )
            if k > 0:
                times[path_name].append(time.perf_counter() - t0)
                cpu[path_name].append(time.process_time() - c0)
        a, c = out["loop"], out["batch_generate"]
        equal.append(
            all(
                torch.equal(getattr(a, f), getattr(c, f))
                for f in ("responses", "response_mask", "rollout_log_probs")
            )
        )
        tokens = int(a.response_mask.sum())
    return {
        "engine": engine_name,
        "rows": rows,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "bit_identical_every_round": all(equal),
        "equal": equal,
        "tokens_last_round": tokens,
        "median_s": {name: statistics.median(v) for name, v in times.items()},
        "median_cpu_s": {name: statistics.median(v) for name, v in cpu.items()},
        "times_s": times,
        "cpu_s": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    res = measure(args.engine, args.rows, args.max_tokens, args.rounds)
    print("RESULT " + json.dumps(res), flush=True)
    os._exit(0)  # skip the engine's teardown (vLLM destroys the process group)


if __name__ == "__main__":
    main()
