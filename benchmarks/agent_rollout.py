"""Multi-turn rollout throughput: continuous scheduling vs turn-synchronous batching.

N trajectories, each with its own number of turns (1..K) and its own turn length; between turns a tool
call that sleeps about t ms: exactly t (``--jitter 0``) or, per call, uniformly within t x (1 +- jitter)
(mean t; real tools vary). ``continuous`` (fusedrl's default) queues each trajectory's next turn on the
engine as soon as its tool answers; ``turn_sync`` runs a turn only once every live trajectory has queued it
and hands results out when the whole batch is done, so each turn waits for the longest generation and the
slowest tool of the batch, as a loop that batches each turn across trajectories does. Both run in one
process on one in-process vLLM engine and the real tool path (thread pool, timeouts), with the same seeds,
so the same tokens. Also measured: the engine's step time with the whole batch in flight and with one
request (how much a step's cost depends on the batch: the regime that decides how much overlapping tool
waits with generation can save), and the load average before and after::

    python -m benchmarks.agent_rollout                      # tiny model, N=32, K=4, t=200 ms; RESULTS.md
    python -m benchmarks.agent_rollout --sleep-ms 50,200 --jitter 0,0.5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from fusedrl.agent import (
    AgentLoop,
    ToolCall,
    ToolSet,
    append_observation,
    assistant_turn,
    register_agent_loop,
)


def bench_sleep(ms: int) -> str:
    """Waits like a slow tool.

    Args:
        ms: milliseconds to wait.
    """
    time.sleep(ms / 1000.0)
    return "done"


@register_agent_loop("bench_turns")
class BenchLoop(AgentLoop):
    """``extra_info``: ``turns`` (assistant turns), ``turn_tokens`` (tokens of each turn), ``sleep_ms`` (the
    tool's latency after each turn)."""

    async def run(self, row, traj, ctx):
        info = row["extra_info"]
        for turn in range(info["turns"]):
            _, stopped = await assistant_turn(traj, ctx, max_tokens=info["turn_tokens"][turn])
            if turn + 1 == info["turns"]:
                return
            call = ToolCall(name="bench_sleep", arguments={"ms": info["sleep_ms"][turn]})
            results = await ctx.call_tools(traj, [call], row)
            if not append_observation(
                traj, ctx, [{"role": "tool", "content": results[0]}], after_stop=stopped
            ):
                return


def workload(n: int, k: int, ms: int, jitter: float, turn_range: tuple[int, int]) -> list[dict]:
    """Each trajectory's ``extra_info``: its turns (1..k), its tokens per turn and its tool latencies."""
    lo, hi = turn_range
    return [
        {
            "turns": 1 + (i * 7) % k,
            # Lengths vary per turn, as responses do: a turn-synchronous batch waits for the longest.
            "turn_tokens": [lo + (i * 13 + turn * 29) % (hi - lo + 1) for turn in range(k)],
            "sleep_ms": tool_latencies(ms, jitter, i, k),
        }
        for i in range(n)
    ]


def modelled_speedup(infos: list[dict], step_s: float) -> float:
    """Turn-synchronous over continuous wall time if an engine step cost ``step_s`` whatever the batch (about
    true on a GPU, and for this tiny model on CPU too: see the measured step times) and every turn sampled its
    full length. Turn-synchronous: per turn, the longest generation plus the slowest tool of the batch.
    Continuous: the longest single trajectory (its generations plus its own tool waits)."""
    k = max(info["turns"] for info in infos)
    sync = 0.0
    for t in range(k):
        live = [info for info in infos if info["turns"] > t]
        sync += max(info["turn_tokens"][t] for info in live) * step_s
        sync += max((info["sleep_ms"][t] for info in live if info["turns"] > t + 1), default=0) / 1000.0
    cont = max(
        sum(info["turn_tokens"][t] * step_s for t in range(info["turns"]))
        + sum(info["sleep_ms"][t] for t in range(info["turns"] - 1)) / 1000.0
        for info in infos
    )
    return sync / cont


def tool_latencies(ms: int, jitter: float, index: int, k: int) -> list[int]:
    """Trajectory ``index``'s tool latency after each turn: ``ms``, or uniform in ``ms x (1 +- jitter)``
    (seeded by the trajectory, so both schedules and every repetition see the same latencies)."""
    rng = random.Random(1000 + index)
    return [round(ms * (1.0 + jitter * rng.uniform(-1.0, 1.0))) for _ in range(k)]


class CountingEngine:
    """The engine as the runner sees it, counting steps, requests per step and seconds inside ``step``: the
    engine's busy time, so a run's wall time splits into busy and idle (waiting for tools with nothing to
    generate). Step counts do not depend on the machine's load; seconds do."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self.steps, self.requests, self.busy_s = 0, 0, 0.0

    def submit(self, request_id, prompt_ids, params) -> None:
        self.engine.submit(request_id, prompt_ids, params)

    def num_unfinished(self) -> int:
        return self.engine.num_unfinished()

    def step(self):
        self.steps += 1
        self.requests += self.engine.num_unfinished()
        t0 = time.perf_counter()
        try:
            return self.engine.step()
        finally:
            self.busy_s += time.perf_counter() - t0


def step_times(engine, prompt: list[int], batch: int, tokens: int, stop_id: int) -> float:
    """Median seconds of one engine step while ``batch`` requests decode ``tokens`` tokens each."""
    from fusedrl.third_party.vllm.engine import SampleParams

    params = SampleParams(max_tokens=tokens, stop_token_ids=(stop_id,), ignore_eos=True, seed=0)
    for i in range(batch):
        engine.submit(f"probe{batch}.{i}", prompt, params)
    times = []
    while engine.num_unfinished() > 0:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first step is the prefill


def measure(
    preset: str,
    n: int,
    k: int,
    sleep_ms: list[int],
    jitters: list[float],
    reps: int,
    turn_range: tuple[int, int],
) -> dict:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from benchmarks.common import model_dir
    from fusedrl.agent import AgentRunner, ChatRenderer, MultiTurnConfig, TurnSampling
    from fusedrl.third_party.vllm import EngineConfig, VLLMEngine

    path = model_dir(preset)
    tok = AutoTokenizer.from_pretrained(path)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(
        EngineConfig(model_path=path, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    )
    renderer = ChatRenderer(tok)
    prompt = tok.encode(
        renderer.render(
            [{"role": "user", "content": "Use the tool, then answer."}], add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    sampling = TurnSampling(temperature=1.0, stop_token_id=tok.eos_token_id)
    out: dict = {"n": n, "k": k, "runs": []}
    step_times(engine, prompt, 4, 8, tok.eos_token_id)  # warm-up
    out["step_s"] = {f"batch_{b}": step_times(engine, prompt, b, 24, tok.eos_token_id) for b in (n, 1)}
    for ms in sleep_ms:
        for jitter in jitters:
            rows = [
                dict(prompt_ids=prompt, seed=i, extra_info=info)
                for i, info in enumerate(workload(n, k, ms, jitter, turn_range))
            ]
            runners = {}
            counting = CountingEngine(engine)
            for schedule in ("turn_sync", "continuous"):
                cfg = MultiTurnConfig(
                    default_agent_name="bench_turns", schedule=schedule, tool_workers=n, tool_timeout_s=60.0
                )
                runners[schedule] = AgentRunner(counting, renderer, ToolSet([bench_sleep]), cfg)
                runners[schedule].run(rows[:2], sampling, max_response_length=900)  # warm-up
            times: dict[str, list[float]] = {"turn_sync": [], "continuous": []}
            busy: dict[str, list[float]] = {"turn_sync": [], "continuous": []}
            steps: dict[str, list[float]] = {"turn_sync": [], "continuous": []}
            reqs: dict[str, list[float]] = {"turn_sync": [], "continuous": []}
            tokens = 0
            load = [os.getloadavg()[0]]
            for rep in range(reps):
                # Alternate the order, so load from other processes on a shared machine hits both alike.
                for schedule in ("turn_sync", "continuous") if rep % 2 == 0 else ("continuous", "turn_sync"):
                    counting.reset()
                    t0 = time.perf_counter()
                    trajs = runners[schedule].run(rows, sampling, max_response_length=900)
                    times[schedule].append(time.perf_counter() - t0)
                    busy[schedule].append(counting.busy_s)
                    steps[schedule].append(counting.steps)
                    reqs[schedule].append(counting.requests)
                    tokens = sum(sum(t.mask) for t in trajs)
            load.append(os.getloadavg()[0])
            # What a schedule that overlapped nothing would wait for tools: the turn-synchronous sum over
            # turns of the slowest latency among the trajectories still running.
            sync_tool_s = (
                sum(
                    max(
                        (r["extra_info"]["sleep_ms"][t] for r in rows if r["extra_info"]["turns"] > t + 1),
                        default=0,
                    )
                    for t in range(k)
                )
                / 1000.0
            )
            for schedule, wall in times.items():
                out["runs"].append(
                    {
                        "sleep_ms": ms,
                        "jitter": jitter,
                        "schedule": schedule,
                        "wall_s": wall,
                        "engine_busy_s": busy[schedule],
                        "engine_steps": steps[schedule],
                        "engine_step_requests": reqs[schedule],
                        "sampled_tokens": tokens,
                        "turn_sync_tool_wait_s": sync_tool_s,
                        "load_avg_1m": load,
                    }
                )
    return out


def render_table(
    res: dict,
    preset: str,
    n: int,
    k: int,
    sleeps: list[int],
    jitters: list[float],
    turn_range: tuple[int, int],
) -> str:
    """The RESULTS.md table of one ``measure`` result."""
    from benchmarks.common import fmt, summary

    lo, hi = turn_range
    step = res["step_s"]
    step_n = step[f"batch_{n}"]
    gpu_step = 0.010  # a typical decode step of a small model on a GPU: an assumption, not measured here

    def engine(run: dict) -> str:
        steps = sorted(run["engine_steps"])  # turn-sync: the same every time; continuous: timing-dependent
        busy = sum(run["engine_busy_s"]) / sum(run["wall_s"])
        span = f"{steps[0]}" if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"
        return f"{span} steps, busy {busy:.0%}"

    rows, tokens = [], 0
    for ms in sleeps:
        for jitter in jitters:
            by = {r["schedule"]: r for r in res["runs"] if r["sleep_ms"] == ms and r["jitter"] == jitter}
            s, c = summary(by["turn_sync"]["wall_s"]), summary(by["continuous"]["wall_s"])
            tokens = by["continuous"]["sampled_tokens"]
            load = by["continuous"]["load_avg_1m"]
            infos = workload(n, k, ms, jitter, turn_range)
            rows.append(
                f"| {ms} | ±{jitter:.0%} | {by['turn_sync']['turn_sync_tool_wait_s']:.1f} s | {fmt(s, ' s', 2)} | "
                f"{fmt(c, ' s', 2)} | {engine(by['turn_sync'])} | {engine(by['continuous'])} | "
                f"{tokens / s['median']:.0f} / {tokens / c['median']:.0f} | {s['median'] / c['median']:.2f}x | "
                f"{s['min'] / c['min']:.2f}x | {modelled_speedup(infos, step_n):.2f}x | "
                f"{modelled_speedup(infos, gpu_step):.2f}x | {load[0]:.1f} / {load[1]:.1f} |"
            )
    return "\n".join(
        [
            f"{n} trajectories, 1-{k} assistant turns each (varied), {lo}-{hi} sampled tokens per turn (varied per "
            f"trajectory and turn), {tokens} sampled tokens in all; a tool call sleeping t ms (± spread, uniform, "
            f"per call) between turns; model `{preset}`, float32, one in-process engine, same seeds and tokens for "
            f"both schedules, schedules alternated per repetition. Engine decode step: {1000 * step_n:.0f} ms "
            f"with {n} requests in flight, {1000 * step['batch_1']:.0f} ms with 1. Modelled: the speed-up if "
            f"every step cost {1000 * step_n:.0f} ms (this run) or {1000 * gpu_step:.0f} ms (a GPU-like step, "
            "assumed) whatever the batch (`modelled_speedup`).",
            "",
            "| tool t (ms) | spread | turn-sync tool wait | turn-synchronous wall | continuous wall | "
            "turn-sync engine | continuous engine | sampled tok/s (sync / cont.) | speed-up (medians) | "
            f"speed-up (best runs) | modelled, {1000 * step_n:.0f} ms step | modelled, {1000 * gpu_step:.0f} ms "
            "step | load avg 1 min before / after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", action="store_true")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--sleep-ms", default="200")
    ap.add_argument("--jitter", default="0,0.5", help="tool latency spread(s): t x (1 +- jitter), uniform")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--turn-tokens", default="8,48", help="min,max sampled tokens of one turn")
    args = ap.parse_args()
    sleeps = [int(x) for x in args.sleep_ms.split(",")]
    jitters = [float(x) for x in args.jitter.split(",")]
    lo, hi = (int(x) for x in args.turn_tokens.split(","))
    if args.one:
        result = measure(args.preset, args.n, args.k, sleeps, jitters, args.reps, (lo, hi))
        print("RESULT " + json.dumps(result), flush=True)
        return

    from benchmarks.common import record, run_in_subprocess

    argv = ["--one", "--preset", args.preset, "--n", str(args.n), "--k", str(args.k)]
    argv += ["--turn-tokens", args.turn_tokens, "--jitter", args.jitter]
    res = run_in_subprocess(
        "benchmarks.agent_rollout",
        [*argv, "--sleep-ms", args.sleep_ms, "--reps", str(args.reps)],
        timeout=3600,
        env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)},
    )
    table = render_table(res, args.preset, args.n, args.k, sleeps, jitters, (lo, hi))
    cmd = (
        f"python -m benchmarks.agent_rollout --n {args.n} --k {args.k} --sleep-ms {args.sleep_ms} "
        f"--jitter {args.jitter} --turn-tokens {args.turn_tokens} --reps {args.reps}"
    )
    record("Multi-turn rollout: continuous vs turn-synchronous", cmd, table, res)


if __name__ == "__main__":
    main()
