"""fusedrl vs TRL's GRPOTrainer on the same GRPO work and the same cores, measured in one run.

The work: a random-init Qwen2 preset (``--preset``: ``small``, 18M parameters, the default; ``tiny``, 0.56M,
where fixed costs per phase and micro-batch dominate) or the real pretrained SmolLM2-135M-Instruct
(``--preset smollm2``, imported once from its PyPI package), 16 prompts x 4 samples, <= 64 response
tokens, one optimizer step per generation batch, a KL term against a reference model (fusedrl
``use_kl_loss=true``, TRL ``beta=0.04``), the arithmetic rule reward, float32 or bfloat16.

TRL is not a fusedrl dependency: install it into a scratch folder and name it with ``--trl-path``::

    pip install --target /tmp/trlpkgs --no-deps trl accelerate datasets multiprocess
    python -m benchmarks.trl_side_by_side --trl-path /tmp/trlpkgs [--rounds 2] [--steps 4]
        [--variants fusedrl-1,fusedrl-2,trl] [--dtype float32] [--preset small]

Each (variant, round) runs in its own process; the variants alternate (A B C A B C ...), so a shared
machine's load falls on all of them alike. The first step of every run is warm-up and is not counted.
TRL generates with Hugging Face ``generate`` (its best mode on a CPU: its vLLM mode needs a server or a
colocated engine on CUDA). fusedrl variants: ``fusedrl-W`` = W fused workers on the machine's cores.
A variant may name its own dtype after ``@`` (``trl@float32``, ``fusedrl-2@bfloat16``); a fusedrl variant
may give the rollout's after a ``/`` (``fusedrl-2@bfloat16/float32``: bf16 training, float32 engine).
``fusedrl-2+default`` is the command a user writes: the work's keys only, every other key at its default
(``auto`` resolved by the workers for this CPU, the engine at the YAML's dtype), whatever ``@dtype`` says.
``fusedrl-2+packed`` turns on ``model.use_remove_padding`` (no compute on padding; what verl's example
scripts set); ``+eager`` runs the rollout engine eager (``rollout.enforce_eager=true``; by default vLLM
compiles its model with torch.compile on CPU); ``+compiled`` compiles the training passes' decoder layers
(``model.compile_layers=true``); ``+unshared`` packs each sample's prompt with it instead of once per
group (``model.share_prompt_prefix=false``; sharing is the default, it acts on packed rows); ``+gloo`` sends the workers' collectives through gloo instead of shared
memory (``FUSEDRL_SHM_COLLECTIVES=0``); ``+glibc`` keeps glibc's malloc in the workers (``FUSEDRL_TCMALLOC=0``;
by default they preload tcmalloc where the machine has it); ``+unbound`` leaves the workers' threads free to
move between cores (``FUSEDRL_BIND_CPUS=0``; by default each worker is bound to its slot's cores). ``trl+tcmalloc`` runs TRL with the same tcmalloc
preloaded (``LD_PRELOAD``), so both sides get the allocator. Flags combine: ``fusedrl-2+packed+eager``.
"vs TRL" divides by the fastest TRL variant's median (TRL's best mode in this run).

Learning curves (``--steps 31 --lr 5e-6``, one round): every run records each step's mean reward and time from
the first step; the table then gives the mean reward of the first and last 10 steps and each run's wall time,
and ``--png PATH`` plots reward per step and per second of training (both sides start from the same model
with the same learning rate; TRL's and fusedrl's samplers see the prompts in their own orders).

``--isa avx2`` emulates an AVX2-only CPU on a newer one: every process runs with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``, so PyTorch's kernels,
oneDNN and MKL use AVX2 only and bf16 matmuls are emulated (measured on an AVX-512 BF16 EPYC: fp32 73 vs
75 GFLOP/s per thread, bf16 2.6 vs 411). vLLM's own compiled CPU kernels (attention, cache ops) still
pick their ISA from the CPU flags, so the rollout's non-matmul part keeps AVX-512: an approximation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from fusedrl.utils.hardware import AVX2_CAP_ENV

PROMPTS, SAMPLES, RESPONSE = 16, 4, 64


def split_variant(variant: str, default_dtype: str) -> tuple[str, str, str]:
    """``name[@dtype[/rollout_dtype]]`` -> (name, training dtype, rollout dtype)."""
    name, _, dtypes = variant.partition("@")
    train, _, rollout = (dtypes or default_dtype).partition("/")
    return name, train, rollout or train


def fusedrl_overrides(
    workers: int,
    dtype: str,
    rollout_dtype: str,
    packed: bool,
    eager: bool,
    compiled: bool,
    shared: bool,
    *,
    default: bool,
    lr: float,
) -> list[str]:
    """A fusedrl variant's keys on top of the benchmark harness's: the work's (micro-batches, learning
    rate), then the variant's choices; ``default``: none of them (the YAML's values, ``auto`` included)."""
    work = [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * SAMPLES // workers}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={PROMPTS * SAMPLES // workers}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={PROMPTS * SAMPLES // workers}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
    ]
    chosen = [
        f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
        f"actor_rollout_ref.rollout.enforce_eager={str(eager).lower()}",
        f"actor_rollout_ref.model.compile_layers={str(compiled).lower()}",
        f"actor_rollout_ref.model.share_prompt_prefix={str(shared).lower()}",
        f"actor_rollout_ref.rollout.dtype={rollout_dtype}",
        f"actor_rollout_ref.actor.fsdp_config.param_dtype={dtype}",
        f"actor_rollout_ref.ref.fsdp_config.param_dtype={dtype}",
        "trainer.emulated_bf16=allow",
    ]
    # The default: the engine back at the YAML's dtype (the benchmark harness pins float32), nothing else set.
    return work + (["actor_rollout_ref.rollout.dtype=bfloat16"] if default else chosen)


def run_fusedrl(
    workers: int,
    steps: int,
    dtype: str,
    preset: str,
    rollout_dtype: str,
    packed: bool = False,
    eager: bool = False,
    compiled: bool = False,
    shared: bool = True,
    default: bool = False,
    lr: float = 1e-6,
) -> dict:
    from benchmarks.step_breakdown import measure

    extra = fusedrl_overrides(
        workers, dtype, rollout_dtype, packed, eager, compiled, shared, default=default, lr=lr
    )
    res = measure(preset, workers, steps, RESPONSE, extra)
    return {
        "curve": res["curve"],
        "step_s": [s["timing_s/step"] for s in res["steps"]],
        "phases": {
            k.split("/", 1)[1]: statistics.median(s[k] for s in res["steps"])
            for k in res["steps"][0]
            if k.startswith("timing_s/")
        },
        "response_tokens": [s.get("response_length/mean", 0.0) for s in res["steps"]],
    }


def is_trl(name: str) -> bool:
    """A TRL variant: ``trl`` or ``trl+tcmalloc``."""
    return name.split("+")[0] == "trl"


def tcmalloc_for_trl() -> str:
    """The tcmalloc fusedrl's workers preload, for a ``trl+tcmalloc`` process (the same allocator)."""
    from fusedrl.trainer.runtime import tcmalloc_path

    path = tcmalloc_path()
    if not path:
        sys.exit(
            "trl+tcmalloc: no tcmalloc on this machine (see docs/architecture.md, the CPU workers' allocator)"
        )
    return path


def run_trl(steps: int, dtype: str, preset: str, lr: float = 1e-6) -> dict:
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.common import arithmetic_data, model_dir
    from fusedrl.rewards.arithmetic import compute_score

    df = pd.read_parquet(arithmetic_data())
    data = Dataset.from_dict(
        {
            "prompt": [list(p) for p in df["prompt"]],
            "ground_truth": [r["ground_truth"] for r in df["reward_model"]],
        }
    )

    def reward(completions: list, ground_truth: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score(t, g) for t, g in zip(texts, ground_truth, strict=True)]

    path = model_dir(preset)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args: object, **kwargs: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS * SAMPLES,
            gradient_accumulation_steps=1,
            num_generations=SAMPLES,
            max_completion_length=RESPONSE,
            beta=0.04,
            learning_rate=lr,
            temperature=1.0,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=dtype == "bfloat16",
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tokenizer
        )
        trainer.add_callback(Timer())
        trainer.train()
        history = trainer.state.log_history
        lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
        rewards = [h["reward"] for h in history if "reward" in h]
    return {
        "step_s": times[1:],
        "phases": {},
        "response_tokens": lengths[1:],
        "curve": list(zip(times, rewards, strict=False)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help="run one variant in this process and print RESULT")
    ap.add_argument("--trl-path", default=os.environ.get("FUSEDRL_TRL_PATH", ""))
    ap.add_argument("--variants", default="fusedrl-1,fusedrl-2,trl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "smollm2"])
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of both sides")
    ap.add_argument("--png", default="", help="plot the reward curves (per step, per second) here")
    ap.add_argument(
        "--isa", default="native", choices=["native", "avx2"], help="avx2: emulate an AVX2-only CPU"
    )
    args = ap.parse_args()
    if args.one:
        name, train, rollout = split_variant(args.one, args.dtype)
        if is_trl(name):  # trl+tcmalloc: the parent process preloaded it (see below)
            res = run_trl(args.steps, train, args.preset, args.lr)
        else:
            base, *flags = name.split("+")
            known = {"packed", "eager", "compiled", "gloo", "glibc", "unbound", "unshared", "default"}
            unknown = set(flags) - known
            if unknown:
                sys.exit(
                    f"unknown variant flag(s) {sorted(unknown)} in {args.one!r}: "
                    f"use {', '.join('+' + f for f in sorted(known))}"
                )
            if "gloo" in flags:  # FSDP2's collectives and the weight stream through gloo, not shared memory
                os.environ["FUSEDRL_SHM_COLLECTIVES"] = "0"
            if "glibc" in flags:  # workers keep glibc's malloc instead of tcmalloc
                os.environ["FUSEDRL_TCMALLOC"] = "0"
            if "unbound" in flags:  # workers' threads free to move between cores
                os.environ["FUSEDRL_BIND_CPUS"] = "0"
            res = run_fusedrl(
                int(base.split("-")[1]),
                args.steps,
                train,
                args.preset,
                rollout,
                packed="packed" in flags,
                eager="eager" in flags,
                compiled="compiled" in flags,
                shared="unshared" not in flags,
                default="default" in flags,
                lr=args.lr,
            )
        import torch

        res["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        print("RESULT " + json.dumps(res), flush=True)
        return

    from benchmarks.common import record, run_in_subprocess

    variants = args.variants.split(",")
    trl_variants = [v for v in variants if is_trl(split_variant(v, args.dtype)[0])]
    if trl_variants and not args.trl_path:
        sys.exit("--trl-path: the folder TRL was installed into (see the module docstring)")
    isa_env = AVX2_CAP_ENV if args.isa == "avx2" else {}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            env = {**isa_env, **({"PYTHONPATH": args.trl_path} if v in trl_variants else {})}
            if v in trl_variants and "+tcmalloc" in v:
                env["LD_PRELOAD"] = tcmalloc_for_trl()
            cli = ["--one", v, "--steps", str(args.steps), "--dtype", args.dtype, "--preset", args.preset]
            cli += ["--lr", str(args.lr)]
            runs[v].append(run_in_subprocess("benchmarks.trl_side_by_side", cli, timeout=3600, env=env))
    steps = {v: [t for r in rs for t in r["step_s"]] for v, rs in runs.items()}
    best_trl = min((statistics.median(steps[v]) for v in trl_variants), default=None)
    capability = sorted({r.get("cpu_capability", "?") for rs in runs.values() for r in rs})
    rows = []
    for v in variants:
        med = statistics.median(steps[v])
        ratio = f"{med / best_trl:.2f}x" if best_trl else "-"
        phases = runs[v][0]["phases"]
        detail = ", ".join(
            f"{p} {phases[p]:.2f}"
            for p in ("gen", "old_log_prob", "ref", "update_actor", "sync_weights")
            if p in phases
        )
        tokens = statistics.median([t for r in runs[v] for t in r["response_tokens"]] or [0.0])
        firsts = " / ".join(f"{r['curve'][0][0]:.1f}" for r in runs[v] if r.get("curve"))
        rows.append(
            f"| {v} | {med:.2f} ({min(steps[v]):.2f}-{max(steps[v]):.2f}, n={len(steps[v])}) | {ratio} "
            f"| {firsts or '-'} | {tokens:.0f} | {detail or '-'} |"
        )
    table = "\n".join(
        [
            f"GRPO step, {args.preset} model, {PROMPTS} prompts x {SAMPLES} samples, <= {RESPONSE} tokens, "
            f"KL against a reference, default dtype {args.dtype}; median step time over {args.rounds} "
            f"alternating rounds x {args.steps - 1} measured steps; vs TRL = / the fastest TRL variant; "
            f"ISA: {args.isa} (torch CPU capability in the runs: {', '.join(capability)}); "
            f"load average at the end: {os.getloadavg()[0]:.1f}",
            "",
            "| variant | step s | vs TRL | first step s, each round | mean response tokens "
            "| fusedrl phases s (first round, median) |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    if args.steps >= 20:
        table += "\n\n" + curve_table(runs)
    if args.png:
        plot_curves(runs, args.png)
    cmd = (
        f"python -m benchmarks.trl_side_by_side --trl-path <scratch> --variants {args.variants} "
        f"--rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --preset {args.preset} "
        f"--isa {args.isa} --lr {args.lr}"
    )
    title = "fusedrl vs TRL GRPOTrainer, side by side" + (
        ", SmolLM2-135M-Instruct" if args.preset == "smollm2" else ""
    )
    block = "trl_side_by_side_smollm2" if args.preset == "smollm2" else ""
    record(title, cmd, table, {v: runs[v] for v in variants}, block=block)


def curve_table(runs: dict[str, list[dict]]) -> str:
    """Per run: mean reward of the first and the last 10 steps, steps, and wall time of all its steps."""
    rows = [
        "| variant (round) | reward, steps 1-10 | reward, last 10 steps | steps | training time s |",
        "|---|---|---|---|---|",
    ]
    for v, rs in runs.items():
        for i, r in enumerate(rs):
            rewards = [rw for _, rw in r["curve"] if rw is not None]
            total = sum(t for t, _ in r["curve"])
            first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
            rows.append(f"| {v} ({i + 1}) | {first:.3f} | {last:.3f} | {len(rewards)} | {total:.0f} |")
    return "\n".join(rows)


def plot_curves(runs: dict[str, list[dict]], path: str) -> None:
    """Reward per step and per second of training, one line per run (the first round of each variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for v, rs in runs.items():
        times = [t for t, _ in rs[0]["curve"]]
        rewards = [rw for _, rw in rs[0]["curve"]]
        elapsed = [sum(times[: i + 1]) for i in range(len(times))]
        by_step.plot(range(1, len(rewards) + 1), rewards, label=v)
        by_time.plot(elapsed, rewards, label=v)
    by_step.set(xlabel="step", ylabel="mean reward of the step's samples", title="per step")
    by_time.set(xlabel="training time, s", ylabel="mean reward", title="per second")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
