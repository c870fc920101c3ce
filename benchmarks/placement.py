"""Per-phase step times and weight-sync cost per placement: one fused worker (in-place sync) against one
training worker + one rollout worker on a pool of its own (bucketed broadcast over gloo).

    python -m benchmarks.placement [--preset small] [--steps 3] [--response-length 64] [--bucket-mb 64]

Each layout runs in its own process (`benchmarks.step_breakdown.measure`); the first step is warm-up. On a
machine where both pools share the same CPU cores this shows what the broadcast route costs, not what a
separate rollout pool gains (that needs devices of its own, and overlapping steps).
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.step_breakdown import PHASES

SYNC_KEYS = ("sync/total_mb", "sync/broadcast_mb", "sync/num_buckets", "sync/broadcast_s", "sync/receive_s")


def layouts(bucket_mb: float) -> dict[str, list[str]]:
    return {
        "fused (1 slot)": [],
        "rollout pool (1 + 1 slots)": [
            "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
            "trainer.placement.roles={rollout: gen}",
            f"trainer.placement.weight_sync_bucket_mb={bucket_mb}",
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    args = ap.parse_args()

    from benchmarks.common import record
    from benchmarks.step_breakdown import measure_in_subprocess

    rows, payload = [], {}
    for name, extra in layouts(args.bucket_mb).items():
        steps = measure_in_subprocess(
            1,
            args.preset,
            args.steps,
            args.response_length,
            ["actor_rollout_ref.actor.use_kl_loss=false", *extra],
        )
        payload[name] = steps

        def med(key: str, steps=steps) -> float:
            return statistics.median(s.get(key, 0.0) for s in steps)

        cells = [f"{med(f'timing_s/{p}'):.2f}" for p in PHASES if p != "ref"]
        sync = [f"{med(k):.3g}" for k in SYNC_KEYS]
        gap = med("rollout/log_prob_abs_diff_max")
        rows.append(
            f"| {name} | {med('timing_s/step'):.2f} | " + " | ".join(cells + sync) + f" | {gap:.1e} |"
        )
    phases = [p for p in PHASES if p != "ref"]
    header = (
        "| placement | step s | "
        + " | ".join(f"{p} s" for p in phases)
        + " | "
        + " | ".join(SYNC_KEYS)
        + " | max abs rollout-actor log-prob |"
    )
    table = "\n".join(
        [
            f"GRPO step, {args.preset} model, 16 prompts x 4 samples, <= {args.response_length} response tokens, "
            f"float32, no KL loss (median of {args.steps - 1} measured steps); both pools share this machine's "
            "cores, so this is the cost of the broadcast route, not the gain of a separate pool",
            "",
            header,
            "|" + "---|" * (len(phases) + len(SYNC_KEYS) + 3),
            *rows,
        ]
    )
    cmd = (
        f"python -m benchmarks.placement --preset {args.preset} --steps {args.steps} "
        f"--response-length {args.response_length} --bucket-mb {args.bucket_mb:g}"
    )
    record("Placement: fused vs rollout pool", cmd, table, json.loads(json.dumps(payload)))


if __name__ == "__main__":
    main()
