"""Multi-turn rollout throughput: continuous scheduling vs turn-synchronous batching.

N trajectories, each with its own number of turns (1..K) and its own turn length; between turns a tool
call that sleeps a latency of mean t ms drawn per call (``--latency``): ``fixed`` (exactly t), ``uniform``
(within t x (1 +- jitter)), ``exp`` (exponential) or ``lognormal`` (log-sd ``--sigma``), seeded per
trajectory so both schedules and every repetition wait the same times. ``continuous`` (fusedrl's default)
queues each trajectory's next turn on the engine as soon as its tool answers; ``turn_sync`` runs a turn
only once every live trajectory has queued it and hands results out when the whole batch is done, so each
turn waits for the longest generation and the slowest tool of the batch, as a loop that batches each turn
across trajectories does. Both run in one
process on one in-process vLLM engine and the real tool path (thread pool, timeouts), with the same seeds,
so the same tokens. Also measured: the engine's step time with the whole batch in flight and with one
request (how much a step's cost depends on the batch: the regime that decides how much overlapping tool
waits with generation can save), and the load average before and after. The engine runs on ``--threads``
torch threads (default 1: on a small shared CPU, an engine on every core starves the tool threads and the
event loop that continuous scheduling runs beside it, as a GPU engine does not; results_archive/2026-12.md,
2026-12-02)::

    python -m benchmarks.agent_rollout                      # tiny model, N=32, K=4, t=200 ms; RESULTS.md
    python -m benchmarks.agent_rollout --sleep-ms 50,200 --latency fixed,uniform --jitter 0.5
    python -m benchmarks.agent_rollout --n 64 --k 8 --turn-tokens 2,6 --latency fixed,exp,lognormal
    python -m benchmarks.agent_rollout --model-only ...     # only the modelled bounds, no engine
"""

from __future__ import annotations

import argparse
import json
import math
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


LATENCIES = ("fixed", "uniform", "exp", "lognormal")


def workload(
    n: int,
    k: int,
    ms: int,
    spread: float,
    turn_range: tuple[int, int],
    latency: str = "uniform",
    seed: int = 1000,
) -> list[dict]:
    """Each trajectory's ``extra_info``: its turns (1..k), its tokens per turn and its tool latencies
    (``tool_latencies``: mean ``ms``, distribution ``latency``, ``spread`` its jitter or log-sd)."""
    lo, hi = turn_range
    return [
        {
            "turns": 1 + (i * 7) % k,
            # Lengths vary per turn, as responses do: a turn-synchronous batch waits for the longest.
            "turn_tokens": [lo + (i * 13 + turn * 29) % (hi - lo + 1) for turn in range(k)],
            "sleep_ms": tool_latencies(ms, spread, i, k, latency, seed),
        }
        for i in range(n)
    ]


def modelled_times(infos: list[dict], step_s: float) -> tuple[float, float]:
    """(turn-synchronous, continuous) wall seconds if an engine step cost ``step_s`` whatever the batch and
    every turn sampled its full length. Turn-synchronous: per turn, the longest generation plus the slowest
    tool of the batch. Continuous: the longest single trajectory (its generations plus its own tool waits).
    Any latency distribution: the draws are in ``info["sleep_ms"]``."""
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
    return sync, cont


def modelled_speedup(infos: list[dict], step_s: float) -> float:
    """Turn-synchronous over continuous wall time (``modelled_times``) if an engine step cost ``step_s``
    whatever the batch (about true on a GPU, and for this tiny model on CPU too: see the measured step
    times). ``step_s=0`` is the tool-bound limit. With a fixed latency t both schedules wait (K-1) t for
    tools (the K-turn trajectory does), so the speed-up is at most the generation ratio and tends to 1 as t
    grows; only varied latencies (the slowest of the batch each turn against one trajectory's own) leave
    more than 1 in the tool-bound limit."""
    sync, cont = modelled_times(infos, step_s)
    return sync / cont if cont > 0 else 1.0


def tool_latencies(
    ms: int, spread: float, index: int, k: int, latency: str = "uniform", seed: int = 1000
) -> list[int]:
    """Trajectory ``index``'s tool latency (ms) after each turn, mean ``ms``: ``fixed``; ``uniform`` in
    ``ms x (1 +- spread)``; ``exp`` exponential; ``lognormal`` with log-sd ``spread`` (log-mean
    ``ln ms - spread^2 / 2``, so the mean stays ``ms``). Seeded by the trajectory, so both schedules and
    every repetition see the same latencies (``seed`` picks another draw set)."""
    rng = random.Random(seed + index)
    if latency == "fixed" or ms <= 0:
        return [ms] * k
    if latency == "uniform":
        return [round(ms * (1.0 + spread * rng.uniform(-1.0, 1.0))) for _ in range(k)]
    if latency == "exp":
        return [round(rng.expovariate(1.0 / ms)) for _ in range(k)]
    if latency == "lognormal":
        mu = math.log(ms) - spread * spread / 2.0
        return [round(rng.lognormvariate(mu, spread)) for _ in range(k)]
    raise ValueError(f"latency must be one of {LATENCIES}, got {latency!r}")


def conditions(latencies: list[str], jitters: list[float], sigmas: list[float]) -> list[tuple[str, float]]:
    """(distribution, spread) pairs to run: uniform once per jitter, lognormal once per sigma."""
    out: list[tuple[str, float]] = []
    for lat in latencies:
        if lat not in LATENCIES:
            raise ValueError(f"latency must be one of {LATENCIES}, got {lat!r}")
        spreads = {"uniform": jitters, "lognormal": sigmas}.get(lat, [0.0])
        out += [(lat, x) for x in spreads]
    return out


def label(latency: str, spread: float) -> str:
    if latency == "uniform":
        return f"uniform ±{spread:.0%}"
    if latency == "lognormal":
        return f"lognormal σ={spread:g}"
    return latency


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
    conds: list[tuple[str, float]],
    reps: int,
    turn_range: tuple[int, int],
    seed: int = 1000,
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
        for latency, spread in conds:
            rows = [
                dict(prompt_ids=prompt, seed=i, extra_info=info)
                for i, info in enumerate(workload(n, k, ms, spread, turn_range, latency, seed))
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
            infos = [r["extra_info"] for r in rows]
            # What a schedule that overlapped nothing would wait for tools: the turn-synchronous sum over
            # turns of the slowest latency among the trajectories still running (the model with free steps).
            sync_tool_s = modelled_times(infos, 0.0)[0]
            drawn = [x for info in infos for x in info["sleep_ms"][: info["turns"] - 1]]
            for schedule, wall in times.items():
                out["runs"].append(
                    {
                        "sleep_ms": ms,
                        "latency": latency,
                        "spread": spread,
                        "schedule": schedule,
                        "wall_s": wall,
                        "engine_busy_s": busy[schedule],
                        "engine_steps": steps[schedule],
                        "engine_step_requests": reqs[schedule],
                        "sampled_tokens": tokens,
                        "turn_sync_tool_wait_s": sync_tool_s,
                        "tool_calls": len(drawn),
                        "tool_ms_mean_max": [statistics.mean(drawn) if drawn else 0, max(drawn, default=0)],
                        "load_avg_1m": load,
                    }
                )
    return out


GPU_STEP = 0.010  # a typical decode step of a small model on a GPU: an assumption, not measured here


def model_table(
    n: int, k: int, sleeps: list[int], conds: list[tuple[str, float]], turn_range, step_s, seed: int = 1000
) -> str:
    """The modelled bounds alone (no engine): speed-up at CPU-like, GPU-like and free engine steps."""
    steps = [step_s, GPU_STEP, 0.0]
    head = " | ".join(f"modelled, {1000 * x:.0f} ms step" for x in steps)
    rows = []
    for ms in sleeps:
        for latency, spread in conds:
            infos = workload(n, k, ms, spread, turn_range, latency, seed)
            cells = " | ".join(f"{modelled_speedup(infos, x):.2f}x" for x in steps)
            rows.append(f"| {ms} | {label(latency, spread)} | {cells} |")
    return "\n".join([f"| tool t (ms) | latency | {head} |", "|---|---|---|---|---|", *rows])


def render_table(
    res: dict,
    preset: str,
    n: int,
    k: int,
    sleeps: list[int],
    conds: list[tuple[str, float]],
    turn_range: tuple[int, int],
    seed: int = 1000,
) -> str:
    """The RESULTS.md table of one ``measure`` result."""
    from benchmarks.common import fmt, summary

    lo, hi = turn_range
    step = res["step_s"]
    step_n = step[f"batch_{n}"]

    def engine(run: dict) -> str:
        steps = sorted(run["engine_steps"])  # turn-sync: the same every time; continuous: timing-dependent
        busy = sum(run["engine_busy_s"]) / sum(run["wall_s"])
        span = f"{steps[0]}" if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"
        return f"{span} steps, busy {busy:.0%}"

    rows, tokens = [], 0
    for ms in sleeps:
        for latency, spread in conds:
            by = {
                r["schedule"]: r
                for r in res["runs"]
                if r["sleep_ms"] == ms and r["latency"] == latency and r["spread"] == spread
            }
            s, c = summary(by["turn_sync"]["wall_s"]), summary(by["continuous"]["wall_s"])
            tokens = by["continuous"]["sampled_tokens"]
            load = by["continuous"]["load_avg_1m"]
            mean_ms, max_ms = by["continuous"]["tool_ms_mean_max"]
            infos = workload(n, k, ms, spread, turn_range, latency, seed)
            rows.append(
                f"| {ms} | {label(latency, spread)} | {mean_ms:.0f} / {max_ms:.0f} | "
                f"{by['turn_sync']['turn_sync_tool_wait_s']:.1f} s | {fmt(s, ' s', 2)} | "
                f"{fmt(c, ' s', 2)} | {engine(by['turn_sync'])} | {engine(by['continuous'])} | "
                f"{tokens / s['median']:.0f} / {tokens / c['median']:.0f} | {s['median'] / c['median']:.2f}x | "
                f"{s['min'] / c['min']:.2f}x | {modelled_speedup(infos, step_n):.2f}x | "
                f"{modelled_speedup(infos, GPU_STEP):.2f}x | {modelled_speedup(infos, 0.0):.2f}x | "
                f"{load[0]:.1f} / {load[1]:.1f} |"
            )
    return "\n".join(
        [
            f"{n} trajectories, 1-{k} assistant turns each (varied), {lo}-{hi} sampled tokens per turn (varied per "
            f"trajectory and turn), {tokens} sampled tokens in all; a tool call between turns sleeping a latency "
            f"of mean t ms drawn per call (same draws for both schedules); model `{preset}`, float32, one "
            f"in-process engine, same seeds and tokens for both schedules, schedules alternated per repetition. "
            f"Engine decode step: {1000 * step_n:.0f} ms with {n} requests in flight, "
            f"{1000 * step['batch_1']:.0f} ms with 1. Modelled: the speed-up if every step cost "
            f"{1000 * step_n:.0f} ms (this run), {1000 * GPU_STEP:.0f} ms (a GPU-like step, assumed) or 0 "
            "(tools only) whatever the batch (`modelled_speedup`).",
            "",
            "| tool t (ms) | latency | drawn mean / max (ms) | turn-sync tool wait | turn-synchronous wall | "
            "continuous wall | turn-sync engine | continuous engine | sampled tok/s (sync / cont.) | "
            "speed-up (medians) | speed-up (best runs) | "
            f"modelled, {1000 * step_n:.0f} ms step | "
            f"modelled, {1000 * GPU_STEP:.0f} ms step | modelled, tools only | load avg 1 min before / after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", action="store_true")
    ap.add_argument("--model-only", action="store_true", help="print the modelled bounds only, no engine")
    ap.add_argument("--model-step-ms", type=float, default=110.0, help="CPU-like step for --model-only")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--sleep-ms", default="200")
    ap.add_argument("--latency", default="uniform", help=f"tool latency distribution(s), of {LATENCIES}")
    ap.add_argument("--jitter", default="0,0.5", help="uniform spread(s): t x (1 +- jitter)")
    ap.add_argument("--sigma", default="1.0", help="lognormal log-sd(s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the engine (0: every core); see results_archive/2026-12.md",
    )
    ap.add_argument("--turn-tokens", default="8,48", help="min,max sampled tokens of one turn")
    ap.add_argument("--seed", type=int, default=1000, help="base seed of the tool latency draws")
    args = ap.parse_args()
    sleeps = [int(x) for x in args.sleep_ms.split(",")]
    conds = conditions(
        args.latency.split(","),
        [float(x) for x in args.jitter.split(",")],
        [float(x) for x in args.sigma.split(",")],
    )
    lo, hi = (int(x) for x in args.turn_tokens.split(","))
    if args.model_only:
        print(model_table(args.n, args.k, sleeps, conds, (lo, hi), args.model_step_ms / 1000.0, args.seed))
        return
    if args.one:
        result = measure(args.preset, args.n, args.k, sleeps, conds, args.reps, (lo, hi), args.seed)
        print("RESULT " + json.dumps(result), flush=True)
        return

    from benchmarks.common import record, run_in_subprocess

    argv = ["--one", "--preset", args.preset, "--n", str(args.n), "--k", str(args.k)]
    argv += ["--turn-tokens", args.turn_tokens, "--latency", args.latency]
    argv += ["--jitter", args.jitter, "--sigma", args.sigma, "--seed", str(args.seed)]
    res = run_in_subprocess(
        "benchmarks.agent_rollout",
        [*argv, "--sleep-ms", args.sleep_ms, "--reps", str(args.reps)],
        timeout=3600,
        env={"OMP_NUM_THREADS": str(args.threads or os.cpu_count() or 1)},
    )
    table = render_table(res, args.preset, args.n, args.k, sleeps, conds, (lo, hi), args.seed)
    cmd = (
        f"python -m benchmarks.agent_rollout --n {args.n} --k {args.k} --sleep-ms {args.sleep_ms} "
        f"--latency {args.latency} --jitter {args.jitter} --sigma {args.sigma} "
        f"--turn-tokens {args.turn_tokens} --reps {args.reps} --threads {args.threads} --seed {args.seed}"
    )
    record("Multi-turn rollout: continuous vs turn-synchronous", cmd, table, res)


if __name__ == "__main__":
    main()
