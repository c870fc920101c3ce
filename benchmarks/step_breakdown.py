"""Where the time of a GRPO step goes, with 1 and 2 fused workers.

Small random-init Qwen2 (18M), 16 prompts x 4 samples, 128 response tokens (EOS rarely sampled by a
random model, so responses are near full length), KL loss on (reference forward included).

    python -m benchmarks.step_breakdown [--steps 3] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync_weights")


def measure(preset: str, workers: int, steps: int) -> dict:
    from benchmarks.trainer_harness import trainer_for

    extra = [
        "data.train_batch_size=16",
        "data.max_prompt_length=64",
        "data.max_response_length=128",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"trainer.total_training_steps={steps}",
    ]
    with tempfile.TemporaryDirectory() as out, trainer_for(preset, workers, extra, out) as trainer:
        per_step = []
        while trainer.global_step < trainer.total_steps:
            trainer.global_step += 1
            per_step.append(trainer.train_step())
    measured = per_step[1:] or per_step  # the first step pays one-time warm-up
    return {"workers": workers, "steps": measured}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", type=int, metavar="WORKERS")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.preset, args.one, args.steps)), flush=True)
        return

    from benchmarks.common import record, run_in_subprocess

    rows, payload = [], {}
    for workers in (1, 2):
        res = run_in_subprocess(
            "benchmarks.step_breakdown",
            ["--one", str(workers), "--preset", args.preset, "--steps", str(args.steps)],
            timeout=1200,
        )
        steps = res["steps"]

        def med(key: str, steps=steps) -> float:
            return statistics.median(s.get(key, 0.0) for s in steps)

        step_t = med("timing_s/step")
        accounted = sum(med(f"timing_s/{p}") for p in PHASES)
        cells = [f"{med(f'timing_s/{p}'):.2f} ({100 * med(f'timing_s/{p}') / step_t:.0f}%)" for p in PHASES]
        rows.append(
            f"| {workers} | {step_t:.2f} | "
            + " | ".join(cells)
            + f" | {step_t - accounted:.3f} | {med('perf/throughput'):.0f} | {med('memory/peak_rss_gb'):.2f} |"
        )
        payload[f"workers_{workers}"] = steps
    header = (
        "| workers | step s | "
        + " | ".join(f"{p} s" for p in PHASES)
        + " | driver other s | tok/s | peak RSS GB/worker |"
    )
    table = "\n".join(
        [
            f"GRPO step, {args.preset} model, 16 prompts x 4 samples, 128 response tokens (median of measured steps)",
            "",
            header,
            "|" + "---|" * (len(PHASES) + 6),
            *rows,
        ]
    )
    record(
        "GRPO step breakdown", f"python -m benchmarks.step_breakdown --preset {args.preset}", table, payload
    )


if __name__ == "__main__":
    main()
