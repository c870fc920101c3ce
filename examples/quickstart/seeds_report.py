"""Several quickstart runs side by side: one plot of every seed's held-out accuracy and training reward per
GRPO step, and a Markdown table of the accuracies, times and memory (the rows in docs/quickstart.md).

    python examples/quickstart/seeds_report.py runs/qs-seed0 runs/qs-seed1 runs/qs-seed2 --png docs/quickstart_seeds.png
"""

from __future__ import annotations

import argparse
import json
import os


def _read(run: str) -> tuple[dict, list[dict]]:
    with open(os.path.join(run, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(run, "grpo", "metrics.jsonl"), encoding="utf-8") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    return summary, metrics


def held_out_points(metrics: list[dict], most: int = 6) -> str:
    """The in-loop held-out accuracy at up to ``most`` evenly spread validations (the last included) and
    its peak: the whole curve is in the plot."""
    vals = [(m["step"], m["val/test_score/mean"]) for m in metrics if "val/test_score/mean" in m]
    if not vals:
        return "-"
    picks = sorted({round(i * (len(vals) - 1) / (most - 1)) for i in range(most)}) if len(vals) > most else []
    shown = [vals[i] for i in picks] if picks else vals
    text = ", ".join(f"{step}: {acc:.1%}" for step, acc in shown)
    peak_step, peak = max(vals, key=lambda v: v[1])
    return f"{text} (peak {peak:.1%} at {peak_step})" if picks else text


def table(runs: list[tuple[dict, list[dict]]]) -> str:
    head = (
        "| seed | untrained | GRPO (steps, loop min) | gain | RFT (SFT steps, min) | held-out by step "
        "| step s (median) | worker peak RSS |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for s, metrics in runs:
        curve = held_out_points(metrics)
        steps = sorted(x for x in s["step_s"] if x)
        rft = f"{s['rft_acc']:.1%} ({s['rft_sft_steps']}, {s['rft_s'] / 60:.1f})" if s["rft_s"] else "-"
        rows.append(
            f"| {s['seed']} | {s['base_acc']:.1%} | **{s['grpo_acc']:.1%}** ({s['grpo_steps']}, "
            f"{s['grpo_s'] / 60:.1f}) | **{s['gain_points']:+.1f}** | {rft} | {curve} | "
            f"{steps[len(steps) // 2]:.0f} | {s['worker_rss_peak_gb']:.1f} GB |"
        )
    return "\n".join(rows)


def plot(runs: list[tuple[dict, list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (s, metrics), color in zip(runs, ("tab:red", "tab:blue", "tab:purple", "tab:orange")):
        vsteps = [0] + [m["step"] for m in metrics if "val/test_score/mean" in m]
        vacc = [s["base_acc"]] + [m["val/test_score/mean"] for m in metrics if "val/test_score/mean" in m]
        ax1.plot(vsteps, vacc, "o-", color=color, label=f"seed {s['seed']}: GRPO")
        if s["rft_s"]:
            ax1.axhline(s["rft_acc"], ls=":", color=color, label=f"seed {s['seed']}: RFT, same wall time")
        steps = [m["step"] for m in metrics if "critic/score/mean" in m]
        ax2.plot(steps, [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m], color=color)
        ax2.plot([], [], color=color, label=f"seed {s['seed']}")
    ax1.set_title("held-out greedy accuracy (256 problems)")
    ax1.set_xlabel("GRPO step (0: the untrained instruct model)")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=7)
    ax2.set_title("training reward (16 problems x 4 samples, T=1)")
    ax2.set_xlabel("GRPO step")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=7)
    fig.suptitle("fusedrl quickstart: GRPO on SmolLM2-135M-Instruct, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="quickstart output folders (--out)")
    p.add_argument("--png", help="write the plot here")
    args = p.parse_args(argv)
    runs = [_read(r) for r in args.runs]
    print(table(runs))
    if args.png:
        plot(runs, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
