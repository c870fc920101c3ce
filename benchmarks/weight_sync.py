"""Weight sync (FSDP2 shards -> vLLM parameters in place): time and peak extra memory vs model size.

Peak extra memory is the storage accounting of `fusedrl.workers.fsdp.StreamStats`: the most bytes of
gathered full tensors alive at once, whoever holds them (us or vLLM's loader). With one worker nothing
is gathered: the shard is the full tensor and is handed to vLLM by reference.

    python -m benchmarks.weight_sync [--presets tiny,small,mid] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile


def measure(preset: str, workers: int, reps: int) -> dict:
    from benchmarks.trainer_harness import trainer_for

    extra = [
        "actor_rollout_ref.actor.use_kl_loss=false",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]
    with tempfile.TemporaryDirectory() as out, trainer_for(preset, workers, extra, out) as trainer:
        trainer.sync_weights()  # warm-up
        runs = [trainer.sync_weights() for _ in range(reps)]
    return {"preset": preset, "workers": workers, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("PRESET", "WORKERS"))
    ap.add_argument("--presets", default="tiny,small,mid")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one[0], int(args.one[1]), args.reps)), flush=True)
        return

    from benchmarks.common import fmt, record, run_in_subprocess, summary

    rows, payload = [], []
    for preset in args.presets.split(","):
        for workers in (1, 2):
            res = run_in_subprocess(
                "benchmarks.weight_sync", ["--one", preset, str(workers), "--reps", str(args.reps)]
            )
            runs = res["runs"]
            t = summary([r["timing_s/sync_weights_inner"] * 1000 for r in runs])
            peak = max(r["sync/peak_live_gathered_mb"] for r in runs)
            largest = runs[0]["sync/largest_tensor_mb"]
            layer = runs[0]["sync/largest_layer_buffer_mb"]
            total = runs[0]["sync/total_mb"]
            # The stream's bound (docs/concepts.md, "Memory bound, measured"): one layer's gathered buffer,
            # plus the largest tensor, which vLLM's loader may still hold while the next one is gathered.
            bound = layer + largest
            rows.append(
                f"| {preset} | {workers} | {total:.1f} | {largest:.2f} | {layer:.2f} | {fmt(t, ' ms', 1)} "
                f"| {peak:.2f} | {peak / bound:.2f}x |"
            )
            payload.append(res)
    table = "\n".join(
        [
            "| model | workers | model MB (fp32) | largest param MB | layer buffer MB | sync time | peak extra MB "
            "| extra / (layer buffer + largest param) |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    record("Weight sync", "python -m benchmarks.weight_sync", table, {"weight_sync": payload})


if __name__ == "__main__":
    main()
