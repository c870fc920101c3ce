"""Full fine-tuning vs LoRA in the fused worker: step time, weight-stream time and bytes, peak RSS,
optimizer-state bytes. One fused worker per run (its own process), GRPO with the KL loss (under LoRA the
reference is the actor with its adapters off), the engine sleeping at level 1 (so LoRA syncs are partial).

    python -m benchmarks.lora [--presets tiny,small] [--steps 3] [--rank 8] [--targets all-linear]
        [--modes full,lora]

``--targets``: LoRA's target_modules (``all-linear``, or comma-separated names such as ``q_proj,v_proj``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile


def measure(preset: str, mode: str, steps: int, rank: int, targets: str) -> dict:
    from benchmarks.trainer_harness import trainer_for

    extra = [
        "data.train_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.sleep_level=1",
        f"trainer.total_training_steps={steps}",
    ]
    if mode == "lora":
        extra += [
            f"actor_rollout_ref.model.lora_rank={rank}",
            f"actor_rollout_ref.model.lora_alpha={2 * rank}",
            "actor_rollout_ref.model.target_modules="
            + (targets if targets == "all-linear" else f"[{targets}]"),
            "actor_rollout_ref.actor.optim.lr=1e-4",
        ]
    with tempfile.TemporaryDirectory() as out, trainer_for(preset, 1, extra, out) as trainer:
        per_step = []
        while trainer.global_step < trainer.total_steps:
            trainer.global_step += 1
            per_step.append(trainer.train_step())
        sizes = trainer.workers.run_rank0(lambda w: w.actor_training_bytes.remote())
    return {"preset": preset, "mode": mode, "steps": per_step[1:] or per_step, "sizes": sizes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("PRESET", "MODE"))
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="all-linear")
    ap.add_argument("--modes", default="full,lora")
    args = ap.parse_args()
    if args.one:
        res = measure(args.one[0], args.one[1], args.steps, args.rank, args.targets)
        print("RESULT " + json.dumps(res), flush=True)
        return

    from benchmarks.common import fmt, record, run_in_subprocess, summary

    load_before = os.getloadavg()
    rows, payload = [], []
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            res = run_in_subprocess(
                "benchmarks.lora",
                ["--one", preset, mode, "--steps", str(args.steps), "--rank", str(args.rank)]
                + ["--targets", args.targets],
                timeout=1800,
            )
            steps = res["steps"]
            step = summary([m["timing_s/step"] for m in steps])
            sync = summary([m["timing_s/sync_weights_inner"] * 1000 for m in steps])
            mb = statistics.median(m["sync/total_mb"] for m in steps)
            rss = max(m["memory/peak_rss_gb"] for m in steps)
            sizes = res["sizes"]
            rows.append(
                f"| {preset} | {mode} | {sizes['trainable_params'] / 1e6:.3f} M | "
                f"{sizes['optimizer_state_bytes'] / 1e6:.2f} | {fmt(step, ' s', 2)} | {fmt(sync, ' ms', 1)} | "
                f"{mb:.2f} | {rss:.2f} |"
            )
            payload.append(res)
    load_after = os.getloadavg()
    table = "\n".join(
        [
            f"1 fused worker, GRPO (8 prompts x 4 samples, 64 response tokens, KL loss), LoRA rank {args.rank} "
            f"alpha {2 * args.rank} on {args.targets}; {args.steps} steps, the first dropped (warm-up). Load "
            f"average (1/5/15 min) before: {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, "
            f"after: {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f}.",
            "",
            "| model | mode | trainable params | optimizer state MB | step time | sync time | sync MB | peak RSS GB |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    record(
        "Full fine-tuning vs LoRA",
        f"python -m benchmarks.lora --presets {args.presets} --steps {args.steps} --rank {args.rank} "
        f"--targets {args.targets} --modes {args.modes}",
        table,
        {"lora": payload},
    )


if __name__ == "__main__":
    main()
