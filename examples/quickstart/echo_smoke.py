"""fusedrl echo smoke run: SFT warm-start, then GRPO with fused workers, against an SFT-only baseline (CPU).

The first quickstart, kept as a fast smoke run of the whole pipeline on a model the project builds (`make
smoke`); the quickstart proper trains a real pretrained model (examples/quickstart/quickstart.py).

The task ("echo"): the prompt asks the model to repeat a 3-digit number, e.g. ``Repeat the number 482.``;
the verifier gives reward 1 when the LAST integer in the response equals that number (the built-in
``arithmetic`` rule). Held-out test prompts use numbers that never occur in any training prompt.

The SFT demonstrations come from two "annotators": one answers ``482.``, the other ``482. Reversed: 284.``.
The second style is correct in spirit but fails the verifier (its last number is the reversal). How often
each style appears depends on the phrasing: two phrasings get the short answer 80% of the time, the other two
only 20% of the time. Imitation reproduces that mix, so greedy decoding picks the short answer on the first
two phrasings and the verbose one on the others: the SFT model scores about half on held-out prompts even
though it copies numbers almost perfectly. More SFT on the same data cannot fix this (it only matches the mix
better). GRPO samples 8 answers per prompt, and the verifier separates the two styles in almost every group,
so the policy learns to stop after the number on every phrasing: held-out accuracy rises to the model's
copying skill.

Stages (all local, nothing downloaded): 1. data, 2. model + tokenizer, 3. SFT warm-start (2 FSDP2 workers),
4. GRPO (2 fused workers: FSDP2 actor + in-process vLLM each), 5. SFT-only baseline: the SFT checkpoint
trained further on the SFT data for the same wall time as the GRPO loop, 6. greedy held-out evaluation of
all three models with the same evaluator, a plot (runs/echo_smoke/quickstart.png) and a summary table.

    python examples/quickstart/echo_smoke.py [--seed 0] [--grpo-steps 30] [--out runs/echo_smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DATA_SOURCE = "arithmetic"  # the reward rule: last integer in the response == ground truth
# (template, probability that the demonstration is the short, verifier-approved answer)
TEMPLATES = (
    ("Repeat the number {n}.", 0.8),
    ("Copy this number: {n}", 0.8),
    ("Say {n} back to me.", 0.2),
    ("Echo the number {n}.", 0.2),
)


# ---------------------------------------------------------------------- 1. data
def _numbers() -> list[int]:
    """3-digit numbers whose reversal is a different number with no leading zero."""
    return [n for n in range(100, 1000) if n % 10 != 0 and str(n) != str(n)[::-1]]


def short_answer(n: int) -> str:
    return f"{n}."


def verbose_answer(n: int) -> str:
    return f"{n}. Reversed: {str(n)[::-1]}."


def _rl_row(n: int, template: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": template.format(n=n)}],
        "ability": "echo",
        "reward_model": {"style": "rule", "ground_truth": str(n)},
        "extra_info": {"split": split, "index": index},
    }


def write_data(out_dir: str, seed: int, n_test: int = 64, sft_per_number: int = 2) -> dict[str, str]:
    """SFT parquet (prompt/response strings), RL train/test parquet (verl schema). Test numbers are held out."""
    import pandas as pd

    rng = random.Random(seed)
    numbers = _numbers()
    rng.shuffle(numbers)
    test_numbers, train_numbers = numbers[:n_test], numbers[n_test:]
    sft_rows = []
    for n in train_numbers:
        for template, p_short in rng.sample(TEMPLATES, sft_per_number):
            response = short_answer(n) if rng.random() < p_short else verbose_answer(n)
            sft_rows.append({"prompt": template.format(n=n), "response": response})
    rl_train = [_rl_row(n, rng.choice(TEMPLATES)[0], "train", i) for i, n in enumerate(train_numbers)]
    # Test: every phrasing equally often, so the SFT model's style split shows as ~half accuracy.
    rl_test = [_rl_row(n, TEMPLATES[i % len(TEMPLATES)][0], "test", i) for i, n in enumerate(test_numbers)]
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "sft": os.path.join(out_dir, "sft.parquet"),
        "train": os.path.join(out_dir, "train.parquet"),
        "test": os.path.join(out_dir, "test.parquet"),
    }
    pd.DataFrame(sft_rows).to_parquet(paths["sft"])
    pd.DataFrame(rl_train).to_parquet(paths["train"])
    pd.DataFrame(rl_test).to_parquet(paths["test"])
    short = sum(r["response"].count(".") == 1 for r in sft_rows) / len(sft_rows)
    print(
        f"[data] {len(sft_rows)} SFT demonstrations ({short:.0%} short answers), {len(rl_train)} RL prompts, "
        f"{len(rl_test)} held-out test prompts (numbers never seen in training)",
        flush=True,
    )
    return paths


# ---------------------------------------------------------------------- evaluation
def greedy_accuracy(
    model_dir: str, test_path: str, max_new_tokens: int = 16
) -> tuple[float, float, list[str]]:
    """Greedy held-out evaluation with Hugging Face generate (the same evaluator for every checkpoint).

    Returns (accuracy: the verifier's score, copy skill: the FIRST integer is the number, responses).
    """
    import re

    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fusedrl.rewards.arithmetic import compute_score

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    df = pd.read_parquet(test_path)
    texts = [
        tok.apply_chat_template([dict(m) for m in p], tokenize=False, add_generation_prompt=True)
        for p in df["prompt"]
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    responses = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    truths = [rm["ground_truth"] for rm in df["reward_model"]]
    scores = [compute_score(r, t) for r, t in zip(responses, truths)]
    first = [re.findall(r"-?\d+", r)[:1] for r in responses]
    skill = [float(f == [t]) for f, t in zip(first, truths)]
    return sum(scores) / len(scores), sum(skill) / len(skill), responses


# ---------------------------------------------------------------------- 3./5. SFT
def sft_overrides(data: dict[str, str], model_dir: str, run_dir: str, lr: float, scheduler: str) -> list[str]:
    return [
        f"data.train_files={data['sft']}",
        "data.max_length=48",
        "data.train_batch_size=32",
        "data.micro_batch_size_per_gpu=16",
        f"model.path={model_dir}",
        f"optim.lr={lr}",
        f"optim.lr_scheduler={scheduler}",
        "optim.min_lr_ratio=0.1",
        "optim.betas=[0.9,0.98]",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.export_dir={os.path.join(run_dir, 'hf')}",
        "trainer.resume_mode=disable",
    ]


def run_sft_stage(overrides: list[str], wall_budget_s: float | None = None) -> tuple[str, float, int]:
    """Run SFT; with ``wall_budget_s``, stop after the step that exhausts the budget. Returns (hf dir, s, steps)."""
    from fusedrl.trainer.runtime import init_ray
    from fusedrl.trainer.sft_trainer import SFTTrainer, export_dir_of, load_sft_config

    config = load_sft_config(overrides)
    init_ray(config)

    class TimedSFT(SFTTrainer):
        t0 = 0.0

        def train_step(self, batch: Any) -> dict[str, float]:
            if self.global_step == 1:
                TimedSFT.t0 = time.monotonic()
            metrics = super().train_step(batch)
            if wall_budget_s is not None and time.monotonic() - TimedSFT.t0 >= wall_budget_s:
                self.total_steps = self.global_step  # ends the loop after this step; fit() then exports
            return metrics

    trainer = TimedSFT(config)
    try:
        trainer.init_workers()
        trainer.fit()
        seconds = time.monotonic() - TimedSFT.t0
        return export_dir_of(config), seconds, trainer.global_step
    finally:
        trainer.close()


# ---------------------------------------------------------------------- 4. GRPO
def grpo_overrides(
    data: dict[str, str], model_dir: str, run_dir: str, steps: int, test_freq: int
) -> list[str]:
    return [
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        "data.train_batch_size=16",
        "data.max_prompt_length=32",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=true",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",
        # eager engines: compiling this 0.9M model takes ~25 s per engine start and saves ~1 s over the run
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        # 1e-4, not 3e-4: at 3e-4 a seed-1 run fell from 0.91 to 0.69 held-out for 4 steps (docs/quickstart.md).
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        "trainer.val_before_train=true",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]


def run_grpo_stage(overrides: list[str], export_to: str) -> tuple[str, float]:
    """GRPO with fused workers; returns (exported HF dir, seconds in the training loop)."""
    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import init_ray, trainer_class

    config = load_config(overrides)
    init_ray(config)
    trainer = trainer_class(config, None)(config)  # AsyncPPOTrainer with async_training.max_staleness > 0
    try:
        trainer.init_workers()
        t0 = time.monotonic()
        trainer.fit()
        seconds = time.monotonic() - t0
        trainer.export_hf(export_to)
        return export_to, seconds
    finally:
        trainer.close()


# ---------------------------------------------------------------------- 6. plot + table
def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(grpo_metrics: list[dict], results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in grpo_metrics if "critic/score/mean" in m]
    reward = [m["critic/score/mean"] for m in grpo_metrics if "critic/score/mean" in m]
    vsteps = [m["step"] for m in grpo_metrics if "val/test_score/mean" in m]
    vacc = [m["val/test_score/mean"] for m in grpo_metrics if "val/test_score/mean" in m]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, reward, label="GRPO train reward (mean of 8 samples/prompt, T=1)", color="tab:blue")
    ax1.plot(vsteps, vacc, "o-", label="GRPO held-out accuracy (greedy, vLLM)", color="tab:red")
    ax1.axhline(results["sft_acc"], ls="--", color="gray", label="SFT warm-start (greedy)")
    ax1.axhline(results["baseline_acc"], ls=":", color="tab:green", label="SFT-only baseline, same wall time")
    ax1.set_xlabel("GRPO step")
    ax1.set_ylabel("reward / accuracy")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title("GRPO on the echo task")
    ax1.legend(fontsize=8, loc="lower right")
    names = ["SFT warm-start", f"SFT-only +{results['baseline_s']:.0f}s", f"GRPO +{results['grpo_s']:.0f}s"]
    accs = [results["sft_acc"], results["baseline_acc"], results["grpo_acc"]]
    bars = ax2.bar(names, accs, color=["gray", "tab:green", "tab:red"])
    for bar, acc in zip(bars, accs):
        ax2.text(bar.get_x() + bar.get_width() / 2, acc + 0.02, f"{acc:.0%}", ha="center")
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("held-out greedy accuracy")
    ax2.set_title(f"same extra wall time (seed {results['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "echo_smoke"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="quick", help="fusedrl.utils.tiny_model preset")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--grpo-steps", type=int, default=30)
    p.add_argument("--test-freq", type=int, default=2)
    p.add_argument(
        "--grpo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more GRPO config override (repeatable), e.g. actor_rollout_ref.actor.optim.lr=1e-4",
    )
    args = p.parse_args(argv)

    import ray

    from fusedrl.utils.tiny_model import build_tiny_model, count_parameters

    t_start = time.monotonic()
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)  # a fresh run every time: no resumed checkpoints, no appended metrics
    os.makedirs(out)
    data = write_data(os.path.join(out, "data"), args.seed)

    model_dir = build_tiny_model(os.path.join(out, "model"), preset=args.preset, seed=args.seed)
    print(
        f"[model] {args.preset}: {count_parameters(model_dir) / 1e6:.2f}M parameters -> {model_dir}",
        flush=True,
    )

    print(f"[sft] warm-start: {args.sft_steps} steps", flush=True)
    sft_dir, sft_s, _ = run_sft_stage(
        sft_overrides(data, model_dir, os.path.join(out, "sft"), args.sft_lr, "cosine")
        + [f"trainer.total_training_steps={args.sft_steps}", f"trainer.seed={args.seed}"]
    )
    sft_acc, sft_skill, sft_resp = greedy_accuracy(sft_dir, data["test"])
    print(
        f"[sft] done in {sft_s:.0f}s; held-out greedy accuracy {sft_acc:.1%} (copy skill {sft_skill:.1%}); e.g. {sft_resp[:4]}",
        flush=True,
    )

    print(f"[grpo] {args.grpo_steps} steps, 16 prompts x 8 samples, 2 fused workers", flush=True)
    grpo_run = os.path.join(out, "grpo")
    grpo_dir, grpo_s = run_grpo_stage(
        grpo_overrides(data, sft_dir, grpo_run, args.grpo_steps, args.test_freq)
        + [f"data.seed={args.seed}", f"actor_rollout_ref.rollout.seed={args.seed}", *args.grpo_set],
        os.path.join(grpo_run, "hf"),
    )
    grpo_acc, grpo_skill, grpo_resp = greedy_accuracy(grpo_dir, data["test"])
    print(
        f"[grpo] loop {grpo_s:.0f}s; held-out greedy accuracy {grpo_acc:.1%} (copy skill {grpo_skill:.1%}); e.g. {grpo_resp[:4]}",
        flush=True,
    )

    print(f"[baseline] SFT-only: continue SFT from the warm-start for the same {grpo_s:.0f}s", flush=True)
    base_dir, base_s, base_steps = run_sft_stage(
        sft_overrides(data, sft_dir, os.path.join(out, "baseline"), args.sft_lr * 0.1, "constant")
        # the wall-time budget ends the run; the step cap (2x the warm-start's pace) only sizes the log's ETA
        + [f"trainer.total_training_steps={int(2 * grpo_s * args.sft_steps / sft_s) + 10}"]
        + [f"trainer.seed={args.seed + 1}"],
        wall_budget_s=grpo_s,
    )
    base_acc, base_skill, base_resp = greedy_accuracy(base_dir, data["test"])
    print(
        f"[baseline] {base_steps} steps in {base_s:.0f}s; held-out greedy accuracy {base_acc:.1%} (copy skill {base_skill:.1%}); "
        f"e.g. {base_resp[:4]}",
        flush=True,
    )
    ray.shutdown()

    metrics = read_jsonl(os.path.join(grpo_run, "metrics.jsonl"))
    vllm_val = [m["val/test_score/mean"] for m in metrics if "val/test_score/mean" in m]
    results = {
        "seed": args.seed,
        "preset": args.preset,
        "sft_steps": args.sft_steps,
        "sft_s": sft_s,
        "sft_acc": sft_acc,
        "sft_copy_skill": sft_skill,
        "grpo_steps": args.grpo_steps,
        "grpo_s": grpo_s,
        "grpo_acc": grpo_acc,
        "grpo_copy_skill": grpo_skill,
        "grpo_val_curve_vllm": vllm_val,
        "baseline_steps": base_steps,
        "baseline_s": base_s,
        "baseline_acc": base_acc,
        "baseline_copy_skill": base_skill,
        "gain_over_sft_points": 100 * (grpo_acc - sft_acc),
        "total_s": time.monotonic() - t_start,
    }
    results["targets_met"] = bool(results["gain_over_sft_points"] >= 15 and grpo_acc > base_acc)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    png = os.path.join(out, "quickstart.png")
    plot(metrics, results, png)

    print("\n=== fusedrl quickstart: held-out greedy accuracy (64 prompts, unseen numbers) ===")
    print(f"{'model':<34}{'accuracy':>10}{'copy skill':>12}{'train time':>12}")
    rows = (
        (f"SFT warm-start ({args.sft_steps} steps)", sft_acc, sft_skill, sft_s),
        (f"+ SFT-only baseline ({base_steps} steps)", base_acc, base_skill, base_s),
        (f"+ GRPO ({args.grpo_steps} steps)", grpo_acc, grpo_skill, grpo_s),
    )
    for name, acc, skill, secs in rows:
        print(f"{name:<34}{acc:>10.1%}{skill:>12.1%}{secs:>11.0f}s")
    print(f"GRPO held-out accuracy during training (vLLM greedy): {' '.join(f'{v:.2f}' for v in vllm_val)}")
    print(f"GRPO - SFT: {results['gain_over_sft_points']:+.1f} points; targets met: {results['targets_met']}")
    print(f"plot: {png}\nsummary: {os.path.join(out, 'summary.json')}\ntotal: {results['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
