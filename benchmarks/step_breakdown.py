"""Where the time of a GRPO step goes, with 1 and 2 fused workers.

Small random-init Qwen2 (18M), 16 prompts x 4 samples, 128 response tokens (EOS rarely sampled by a
random model, so responses are near full length), KL loss on (reference forward included).

    python -m benchmarks.step_breakdown [--steps 3] [--preset small] [--response-length 128]
        [--layouts 1,2] [--rounds 1] [--extra key=value ...]

``--layouts``: comma-separated worker layouts, each ``W`` (W workers, threads from their CPU share) or
``WxT`` (W workers forced to T torch threads each through ``OMP_NUM_THREADS``). ``--rounds R`` runs the
layouts R times in alternation (A B A B ...), so a shared machine's load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync_weights")


def measure(preset: str, workers: int, steps: int, response_length: int, more: list[str]) -> dict:
    from benchmarks.trainer_harness import trainer_for

    extra = [
        "data.train_batch_size=16",
        "data.max_prompt_length=64",
        f"data.max_response_length={response_length}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.adv_estimator=grpo",
        f"trainer.total_training_steps={steps}",
        *more,
    ]
    with tempfile.TemporaryDirectory() as out, trainer_for(preset, workers, extra, out) as trainer:
        per_step = []
        while trainer.global_step < trainer.total_steps:
            trainer.global_step += 1
            per_step.append(trainer.train_step())
    measured = per_step[1:] or per_step  # the first step pays one-time warm-up
    import os

    return {
        "workers": workers,
        "threads": os.environ.get("OMP_NUM_THREADS", "auto"),
        "steps": measured,
        # every step, the first included: the learning curve from the start
        "curve": [(s["timing_s/step"], s.get("critic/score/mean")) for s in per_step],
    }


def measure_in_subprocess(
    workers: int | str,
    preset: str,
    steps: int,
    response_length: int,
    overrides: list[str],
    env: dict[str, str] | None = None,
) -> list[dict]:
    """`measure` in a process of its own (one engine per process); the per-step metrics."""
    from benchmarks.common import run_in_subprocess

    cli = ["--one", str(workers), "--preset", preset, "--steps", str(steps)]
    cli += ["--response-length", str(response_length), "--extra", *overrides]
    return run_in_subprocess("benchmarks.step_breakdown", cli, timeout=1800, env=env)["steps"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", type=int, metavar="WORKERS")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--layouts", default="1,2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="more config overrides (key=value)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a named set of overrides (on top of --extra); several alternate with the layouts each round",
    )
    args = ap.parse_args()
    if args.one:
        res = measure(args.preset, args.one, args.steps, args.response_length, args.extra)
        print("RESULT " + json.dumps(res), flush=True)
        return

    from benchmarks.common import record

    variants: dict[str, list[str]] = {"": []}
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, ovs = spec.partition(":")
            variants[name] = [ov for ov in ovs.split(",") if ov]
    cases = [
        (layout, name) for layout in args.layouts.split(",") for name in variants
    ]  # each round runs every case once, in this order
    runs: dict[str, list[dict]] = {f"{lay} {name}".strip(): [] for lay, name in cases}
    for _ in range(args.rounds):
        for layout, name in cases:
            workers, _, threads = layout.partition("x")
            steps = measure_in_subprocess(
                workers,
                args.preset,
                args.steps,
                args.response_length,
                [*args.extra, *variants[name]],
                env={"OMP_NUM_THREADS": threads} if threads else None,
            )
            runs[f"{layout} {name}".strip()].extend(steps)

    rows, payload = [], {}
    for layout, steps in runs.items():

        def med(key: str, steps=steps) -> float:
            return statistics.median(s.get(key, 0.0) for s in steps)

        step_t = med("timing_s/step")
        accounted = sum(med(f"timing_s/{p}") for p in PHASES)
        cells = [f"{med(f'timing_s/{p}'):.2f} ({100 * med(f'timing_s/{p}') / step_t:.0f}%)" for p in PHASES]
        rows.append(
            f"| {layout} | {step_t:.2f} | "
            + " | ".join(cells)
            + f" | {step_t - accounted:.3f} | {med('perf/throughput'):.0f} | {med('memory/peak_rss_gb'):.2f} |"
        )
        payload[f"layout_{layout}"] = steps
    header = (
        "| workers[xthreads] [variant] | step s | "
        + " | ".join(f"{p} s" for p in PHASES)
        + " | driver other s | tok/s | peak RSS GB/worker |"
    )
    extra = f"; overrides: {' '.join(args.extra)}" if args.extra else ""
    table = "\n".join(
        [
            f"GRPO step, {args.preset} model, 16 prompts x 4 samples, <= {args.response_length} response tokens "
            f"(median of {args.rounds} x {args.steps - 1} measured steps per layout{extra})",
            "",
            header,
            "|" + "---|" * (len(PHASES) + 5),
            *rows,
        ]
    )
    cmd = " ".join(
        [
            "python -m benchmarks.step_breakdown",
            f"--preset {args.preset}",
            f"--steps {args.steps}",
            f"--response-length {args.response_length}",
            f"--layouts {args.layouts}",
            f"--rounds {args.rounds}",
        ]
        + ([f"--extra {' '.join(args.extra)}"] if args.extra else [])
        + [f"--variant '{v}'" for v in args.variant]
    )
    record("GRPO step breakdown", cmd, table, payload)


if __name__ == "__main__":
    main()
