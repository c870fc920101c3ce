"""How a GRPO step's cost grows: step time and peak memory per worker against response length and batch size.

The grid: model presets (tiny/small/mid) x response lengths (64/256/1024 tokens) x batch sizes
(16/64/256 samples = 4/16/64 prompts x 4 samples). ``--cross`` (the default) runs the cross through the
middle of the grid for each preset: every response length at 64 samples, and every batch size at 64
tokens (5 cells per preset); ``--full`` runs every combination (9 per preset). Each cell is its own
process (a fresh Ray runtime and vLLM engine), GRPO with the KL loss, float32, the default worker layout
(``trainer.n_gpus_per_node``), ``--steps`` steps of which the first (warm-up) is dropped. A random-init
model rarely samples EOS, so responses run to about the full length.

Results: a table in RESULTS.md and the whole run in benchmarks/results_archive/ (via
`benchmarks.common.record`), and a PNG plot (``--plot``).

    python -m benchmarks.growth [--presets tiny,small,mid] [--lengths 64,256,1024] [--batches 16,64,256]
        [--full] [--steps 2] [--plot benchmarks/growth.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile


def measure(preset: str, samples: int, length: int, steps: int, workers: int, more: list[str]) -> dict:
    """One cell, in this process: median step time and the workers' peak RSS after ``steps`` steps
    (``more``: further config overrides, e.g. gradient checkpointing for cells that do not fit)."""
    from benchmarks.trainer_harness import trainer_for

    prompts = samples // 4
    micro = max(1, min(8, samples // workers))
    extra = [
        f"data.train_batch_size={prompts}",
        "data.max_prompt_length=64",
        f"data.max_response_length={length}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"trainer.total_training_steps={steps}",
        *more,
    ]
    with tempfile.TemporaryDirectory() as out, trainer_for(preset, workers, extra, out) as trainer:
        per_step = []
        while trainer.global_step < trainer.total_steps:
            trainer.global_step += 1
            per_step.append(trainer.train_step())
    measured = per_step[1:] or per_step
    return {
        "step_s": statistics.median(s["timing_s/step"] for s in measured),
        "gen_s": statistics.median(s["timing_s/gen"] for s in measured),
        "update_s": statistics.median(s["timing_s/update_actor"] for s in measured),
        "peak_rss_gb": max(s["memory/peak_rss_gb"] for s in per_step),
        "response_tokens": statistics.median(s.get("response_length/mean", length) for s in measured),
    }


def cells(
    presets: list[str], lengths: list[int], batches: list[int], full: bool
) -> list[tuple[str, int, int]]:
    """(preset, samples, response length) of each cell, in run order."""
    mid_len = 64 if 64 in lengths else lengths[0]
    mid_batch = 64 if 64 in batches else batches[0]
    out: list[tuple[str, int, int]] = []
    for preset in presets:
        if full:
            out += [(preset, b, n) for b in batches for n in lengths]
        else:
            out += [(preset, mid_batch, n) for n in lengths]
            out += [(preset, b, mid_len) for b in batches if b != mid_batch]
    return out


def plot(results: list[dict], path: str) -> None:
    """Step time and peak RSS against response length (at the middle batch) and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for preset in sorted({r["preset"] for r in results}):
        mine = [r for r in results if r["preset"] == preset]
        by_len = sorted((r for r in mine if r["samples"] == 64), key=lambda r: r["length"])
        by_batch = sorted((r for r in mine if r["length"] == 64), key=lambda r: r["samples"])
        for col, rows, key in ((0, by_len, "length"), (1, by_batch, "samples")):
            if rows:
                xs = [r[key] for r in rows]
                axes[0][col].plot(xs, [r["step_s"] for r in rows], "o-", label=preset)
                axes[1][col].plot(xs, [r["peak_rss_gb"] for r in rows], "o-", label=preset)
    for row, ylabel in ((0, "step time (s)"), (1, "peak RSS per worker (GB)")):
        for col, xlabel in ((0, "response length (tokens), 64 samples"), (1, "batch (samples), 64 tokens")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            if row == 0:  # step times span three orders of magnitude across presets
                ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle("fusedrl GRPO step: growth with response length and batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def recorded_cells(archive_dir: str, since: str) -> list[dict]:
    """Every cell the growth runs recorded in the results archive (``YYYY-MM.md`` files; the page keeps only
    the last run) at or after ``since`` (``YYYY-MM-DD HH:MM``), the latest run of each (preset, samples,
    length) winning."""
    import re
    from pathlib import Path

    latest: dict[tuple[str, int, int], dict] = {}
    text = "".join(p.read_text() for p in sorted(Path(archive_dir).glob("????-??.md")))
    sections = re.split(r"\n### ", text)
    for section in sections:
        head = re.match(r"GRPO step growth — (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", section)
        raw = re.search(r"```json\n(.*?)\n```", section, re.S)
        if not head or not raw or head.group(1) < since:
            continue
        for cell in json.loads(raw.group(1)).get("cells", []):
            latest[(cell["preset"], cell["samples"], cell["length"])] = cell
    return list(latest.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=3, metavar=("PRESET", "SAMPLES", "LENGTH"))
    ap.add_argument("--presets", default="tiny,small,mid")
    ap.add_argument("--lengths", default="64,256,1024")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--full", action="store_true", help="every combination instead of the cross")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--plot", default="benchmarks/growth.png")
    ap.add_argument("--extra", nargs="*", default=[], help="more config overrides (key=value) for every cell")
    ap.add_argument(
        "--replot",
        metavar="SINCE",
        help="no run: plot the cells recorded in benchmarks/results_archive/ since 'YYYY-MM-DD HH:MM' (UTC)",
    )
    args = ap.parse_args()
    if args.replot:
        from benchmarks.results_page import ARCHIVE_DIR

        plot(recorded_cells(str(ARCHIVE_DIR), args.replot), os.path.join(os.getcwd(), args.plot))
        return
    if args.one:
        preset, samples, length = args.one[0], int(args.one[1]), int(args.one[2])
        res = measure(preset, samples, length, args.steps, args.workers, args.extra)
        print("RESULT " + json.dumps(res), flush=True)
        return

    from benchmarks.common import record, run_in_subprocess

    todo = cells(
        args.presets.split(","),
        [int(x) for x in args.lengths.split(",")],
        [int(x) for x in args.batches.split(",")],
        args.full,
    )
    results, rows = [], []
    for preset, samples, length in todo:
        one = ["--one", preset, str(samples), str(length), "--steps", str(args.steps), "--extra", *args.extra]
        try:
            res = run_in_subprocess("benchmarks.growth", [*one, "--workers", str(args.workers)], timeout=3600)
        except (RuntimeError, OSError) as err:  # a cell that fails (e.g. out of memory) is named, not hidden
            print(f"cell {preset} {samples} {length} failed: {str(err)[-300:]}", flush=True)
            rows.append(f"| {preset} | {samples} | {length} | failed | | | |")
            continue
        row = {"preset": preset, "samples": samples, "length": length, **res}
        results.append(row)
        print("CELL " + json.dumps(row), flush=True)
        rows.append(
            f"| {preset} | {samples} | {length} | {res['step_s']:.2f} | {res['gen_s']:.2f} | "
            f"{res['update_s']:.2f} | {res['peak_rss_gb']:.2f} |"
        )
    if results and args.plot:
        plot(results, os.path.join(os.getcwd(), args.plot))
    table = "\n".join(
        [
            f"GRPO step growth, float32, {args.workers} workers, median of {max(1, args.steps - 1)} measured "
            f"step(s) per cell (first step dropped); cells run: {'full grid' if args.full else 'cross'} of "
            f"presets {args.presets}, response lengths {args.lengths}, batches {args.batches} samples."
            + (f" Plot: `{args.plot}`." if args.plot and results else ""),
            "",
            "| preset | samples | response tokens (max) | step s | gen s | update s | peak RSS GB/worker |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    cmd = (
        f"python -m benchmarks.growth --presets {args.presets} --lengths {args.lengths} --batches {args.batches}"
        f"{' --full' if args.full else ''} --steps {args.steps} --workers {args.workers}"
        + (f" --extra {' '.join(args.extra)}" if args.extra else "")
    )
    record("GRPO step growth", cmd, table, {"cells": results})


if __name__ == "__main__":
    main()
