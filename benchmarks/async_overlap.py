"""One-step-off async training: (a) real runs' per-phase times and sync cost per placement, (b) a scheduling
simulation fed with those times that predicts the async speedup on devices of its own.

    python -m benchmarks.async_overlap [--preset small] [--steps 4] [--response-length 32] [--sim-steps 100]

(a) Three layouts, each in its own process (`benchmarks.step_breakdown.measure`, first step warm-up): one
fused worker; one training worker + one rollout worker on a pool of its own (synchronous); the same two
pools with ``async_training.max_staleness=1``. On this machine both pools share the same CPU cores (and
other processes' load), so the async row's wall time is no honest measure of the overlap's gain.

(b) `simulate` replays N steps of the dependency graph of each schedule with the synchronous rollout-pool
run's median phase times (generation G on the rollout pool; training T = reward + old log-probs + ref +
advantages + update on the training pool; sync S, which holds both):

- synchronous, separate pools: every step is G + T + S, each pool idle while the other works;
- one-step-off: generation k+1 starts when batch k is taken and the weights of update k-1 are in the
  engine; training k starts when batch k is there and sync k-1 is done; sync k starts when update k and
  generation k+1 are done. In steady state a step costs max(G, T) + S.
"""

from __future__ import annotations

import argparse
import json
import statistics

GEN_PHASES = ("gen",)
TRAIN_PHASES = ("reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
SYNC_PHASES = ("sync_weights",)
ASYNC_KEYS = ("async/gen_s", "async/overlap_s", "async/gen_wait_s")
POOLS = [
    "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
    "trainer.placement.roles={rollout: gen}",
]
LAYOUTS = {
    "fused (1 slot)": ["algorithm.rollout_correction.rollout_is=token"],  # the same passes as the others
    "rollout pool, sync (1 + 1 slots)": [*POOLS, "algorithm.rollout_correction.rollout_is=token"],
    "rollout pool, async max_staleness=1 (1 + 1 slots)": [
        *POOLS,
        "algorithm.rollout_correction.rollout_is=token",
        "async_training.max_staleness=1",
    ],
}


def simulate(gen: float, train: float, sync: float, steps: int, staleness: int) -> float:
    """Wall time of ``steps`` RL steps with the given phase times: ``staleness=0`` the synchronous schedule,
    1 the one-step-off schedule (`trainer/async_trainer.py`)."""
    if staleness == 0:
        return steps * (gen + train + sync)
    gen_done = {1: gen}  # generation of step 1 starts at 0
    sync_done = {0: 0.0}
    for k in range(1, steps + 1):
        train_start = max(gen_done[k], sync_done[k - 1])
        if k < steps:  # the next batch is sent when this one is taken (engine holds version k-1)
            gen_done[k + 1] = train_start + gen
        train_done = train_start + train
        sync_start = max(train_done, gen_done.get(k + 1, 0.0))
        sync_done[k] = sync_start + sync
    return sync_done[steps]


def phase_sums(step: dict) -> tuple[float, float, float]:
    """(generation, training, sync) seconds of one step's metrics."""

    def total(names: tuple[str, ...]) -> float:
        return sum(float(step.get(f"timing_s/{n}", 0.0)) for n in names)

    return total(GEN_PHASES), total(TRAIN_PHASES), total(SYNC_PHASES)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--sim-steps", type=int, default=100)
    args = ap.parse_args()

    from benchmarks.common import record
    from benchmarks.step_breakdown import measure_in_subprocess

    rows: list[str] = []
    payload: dict[str, object] = {}
    medians: dict[str, tuple[float, float, float]] = {}
    for name, extra in LAYOUTS.items():
        steps = measure_in_subprocess(
            1,
            args.preset,
            args.steps,
            args.response_length,
            ["actor_rollout_ref.actor.use_kl_loss=false", *extra],
        )
        payload[name] = steps

        def med(key: str, steps=steps) -> float:
            return statistics.median(float(s.get(key, 0.0)) for s in steps)

        g, t, s = (statistics.median(p[i] for p in map(phase_sums, steps)) for i in range(3))
        medians[name] = (g, t, s)
        asyncs = " | ".join(f"{med(k):.2f}" if k in steps[0] else "-" for k in ASYNC_KEYS)
        rows.append(
            f"| {name} | {med('timing_s/step'):.2f} | {g:.2f} | {t:.2f} | {s:.2f} | "
            f"{med('sync/broadcast_mb'):.1f} | {med('sync/broadcast_s'):.3f} | {asyncs} |"
        )
    measured = "\n".join(
        [
            f"(a) GRPO step, {args.preset} model, 16 prompts x 4 samples, <= {args.response_length} response "
            f"tokens, float32, no KL loss, rollout_is=token (median of {args.steps - 1} measured steps). "
            "Both pools share this machine's 2 cores (and other processes' load): the async row's step time "
            "is NOT a measure of what the overlap gains on devices of its own.",
            "",
            "| placement | step s | gen s | train s (reward+log-probs+adv+update) | sync s | sync MB sent | "
            "broadcast s | async/gen_s | async/overlap_s | async/gen_wait_s |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    g, t, s = medians["rollout pool, sync (1 + 1 slots)"]
    n = args.sim_steps
    sync_total, async_total = simulate(g, t, s, n, 0), simulate(g, t, s, n, 1)
    sim_rows = [
        f"| measured (G={g:.2f}, T={t:.2f}, S={s:.2f}) | {sync_total / n:.2f} | {async_total / n:.2f} | "
        f"{sync_total / async_total:.2f}x |"
    ]
    for label, (gg, tt) in {
        "balanced (G = T = (G+T)/2)": ((g + t) / 2, (g + t) / 2),
        "generation-bound (G = 3 T)": (0.75 * (g + t), 0.25 * (g + t)),
    }.items():
        a, b = simulate(gg, tt, s, n, 0), simulate(gg, tt, s, n, 1)
        sim_rows.append(f"| {label} | {a / n:.2f} | {b / n:.2f} | {a / b:.2f}x |")
    simulated = "\n".join(
        [
            f"(b) Scheduling simulation, {n} steps, phase times from the synchronous rollout-pool row (each "
            "pool alone on its device: generation and training do not slow each other). Steady state: sync "
            "G + T + S per step, one-step-off max(G, T) + S.",
            "",
            "| phase times | sync s/step | async s/step | predicted speedup |",
            "|---|---|---|---|",
            *sim_rows,
        ]
    )
    cmd = (
        f"python -m benchmarks.async_overlap --preset {args.preset} --steps {args.steps} "
        f"--response-length {args.response_length} --sim-steps {n}"
    )
    payload["simulation"] = {
        "gen": g,
        "train": t,
        "sync": s,
        "sync_total": sync_total,
        "async_total": async_total,
    }
    record(
        "Async one-step-off: measured phases and simulated overlap",
        cmd,
        measured + "\n\n" + simulated,
        payload,
    )
    print(json.dumps(payload["simulation"]))


if __name__ == "__main__":
    main()
