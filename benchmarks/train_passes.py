"""The training half of a GRPO step, in isolation: old log-probs, reference, update — against a plain HF
forward+backward of the same sequences and the machine's matmul ceiling.

The fused worker's roles (`ActorRole`, `RefRole`, FSDP2 over a real gloo group of ``W`` processes with
``T`` torch threads each) run on a synthetic batch of the GRPO benchmark's shape (64 samples; prompts of
15-35 real tokens left-padded to 64; responses of up to ``--response-length`` tokens, three quarters at
full length as from a random model). No Ray, no vLLM: only the passes. Reported per phase: seconds,
GFLOP/s (FLOPs counted by ``torch.utils.flop_counter`` on the real tokens' forward/backward), and the
top operators by self CPU time (``torch.profiler``) on rank 0. The bf16 ceiling is measured only where the CPU
multiplies bf16 natively or the run asks for bf16 (`ceiling_dtypes`; emulated, it takes minutes a round); the
output says when it was left out. The ranks run with the allocator a fused worker
gets: tcmalloc preloaded where the machine has it (`fusedrl.trainer.runtime.tcmalloc_path`;
``FUSEDRL_TCMALLOC=0``: glibc's malloc), each bound to ``T`` cores of its own (``FUSEDRL_BIND_CPUS=0``: unbound).

``--variants`` measures switches of the implementation side by side in one process, alternating, so a
shared machine's load falls on all alike: ``base`` (everything on, float32), ``no_trim`` (micro-batches
keep their all-padding columns, the behaviour before the trim), ``regather`` (FSDP2 re-gathers every unit
for each micro-batch's forward and backward, its default, instead of once per pass), ``gloo`` and
``bf16_gloo`` (FSDP2's collectives through gloo instead of shared memory, `fusedrl.workers.shm_collectives`), ``bf16`` (the same roles
under FSDP2 bf16 mixed precision, with ``model.attn_implementation=auto``: on CPU short sequences run as
two matmuls, `fusedrl.workers.cpu_attention`), ``bf16_sdpa`` (the same with plain SDPA attention),
``packed`` and ``bf16_packed`` (``model.use_remove_padding=true``: no compute on padding), ``compiled`` and
``bf16_compiled`` (``model.compile_layers=true``: torch.compile of each decoder layer, compiled during the
warm-up, which is not timed: the passes on a batch of other lengths, then on the timed one, so the timed
passes run the dynamic-shape graph every step of a run after its first runs), ``packed_compiled`` and ``bf16_packed_compiled`` (both). A suffix
``_unshared`` turns ``model.share_prompt_prefix`` off; ``_plaingrad`` keeps PyTorch's own linear weight
gradients in the compiled layers (`fusedrl.workers.layer_compile.RowMajorGradLinear` off).

    python -m benchmarks.train_passes [--layouts 1x2,2x1] [--preset small] [--reps 3] [--variants base,no_trim]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch

PHASES = ("old_log_prob", "ref", "update", "hf_fwd_bwd")
ROWS = 64
TP = 64


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synthetic_batch(response_length: int, seed: int = 0, samples_per_prompt: int = 1):
    """64 rows shaped like a GRPO batch of a random model on the arithmetic prompts; ``samples_per_prompt``
    consecutive rows share their prompt (GRPO's groups; 1: every row its own prompt)."""
    from fusedrl.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    tr = response_length
    prompts = torch.zeros(ROWS, TP, dtype=torch.long)
    prompt_mask = torch.zeros(ROWS, TP, dtype=torch.long)
    responses = torch.zeros(ROWS, tr, dtype=torch.long)
    response_mask = torch.zeros(ROWS, tr, dtype=torch.long)
    for i in range(ROWS):
        new_prompt = i % samples_per_prompt == 0
        lp = int(torch.randint(15, 36, (1,), generator=g)) if new_prompt else 0
        lr = tr if torch.rand(1, generator=g) < 0.75 else int(torch.randint(1, tr + 1, (1,), generator=g))
        if new_prompt:
            prompts[i, TP - lp :] = torch.randint(3, 500, (lp,), generator=g)
            prompt_mask[i, TP - lp :] = 1
        else:  # the group's prompt
            prompts[i], prompt_mask[i] = prompts[i - 1], prompt_mask[i - 1]
        responses[i, :lr] = torch.randint(3, 500, (lr,), generator=g)
        response_mask[i, :lr] = 1
    batch = RolloutBatch(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=responses,
        response_mask=response_mask,
        batch_size=[ROWS],
    )
    batch.advantages = torch.randn(ROWS, tr, generator=g) * response_mask
    return batch


def matmul_ceiling(dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of a [2048 x 512] @ [512 x 1408] matmul (the small preset's MLP shape), best of ``reps``."""
    a = torch.randn(2048, 512).to(dtype)
    b = torch.randn(512, 1408).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * 2048 * 512 * 1408 / best / 1e9


def ceiling_dtypes(param_dtype: str | None, variants: list[str], native: bool) -> tuple[list[str], str]:
    """The dtypes whose matmul ceiling a run measures, and a note for its output when bf16 is left out.

    float32 always; bfloat16 where the CPU multiplies bf16 in hardware (``native``,
    `fusedrl.utils.hardware.native_bf16`) or the run asks for bf16 (``--param-dtype bfloat16`` or a ``bf16``
    variant). Without native bf16 the ceiling's matmul is emulated: ~4.7 s each on an AVX2-only EPYC, 31 of
    them a round, minutes that a float32 run does not need."""
    if native or param_dtype in ("bfloat16", "bf16") or any(v.startswith("bf16") for v in variants):
        return ["float32", "bfloat16"], ""
    return ["float32"], "bf16 not measured (no native bf16 and no bf16 pass asked for)"


def _count_flops(model, batch, micro: int) -> dict[str, float]:
    """FLOPs of the real tokens of ``batch`` (packed, no padding): ``fwd`` and ``fwd_bwd`` count every
    sample's whole sequence; ``fwd_held`` and ``fwd_bwd_held`` the work a packed row with shared prompts
    executes: the linears' FLOPs (``mm``/``addmm``) scaled by the tokens the shared row holds, the rest
    (attention: each sample still attends over its whole sequence) as counted."""
    from torch.utils.flop_counter import FlopCounterMode

    from fusedrl.workers.logprob import micro_batches
    from fusedrl.workers.packing import pack_batch

    linear_ops = {torch.ops.aten.mm, torch.ops.aten.addmm}

    def totals(counter: FlopCounterMode, held_share: float) -> tuple[float, float]:
        total = counter.get_total_flops()
        linear = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op in linear_ops)
        return total, total - linear * (1.0 - held_share)

    out = dict.fromkeys(("fwd", "fwd_held", "fwd_bwd", "fwd_bwd_held"), 0.0)
    for mb in micro_batches(batch, micro):
        packed = pack_batch(mb)
        held_share = pack_batch(mb, share_prompts=True).input_ids.shape[1] / packed.input_ids.shape[1]
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            packed.forward(model)
        whole, held = totals(counter, held_share)
        out["fwd"], out["fwd_held"] = out["fwd"] + whole, out["fwd_held"] + held
        with FlopCounterMode(display=False) as counter:
            packed.forward(model).logits.float().sum().backward()
        whole, held = totals(counter, held_share)
        out["fwd_bwd"], out["fwd_bwd_held"] = out["fwd_bwd"] + whole, out["fwd_bwd_held"] + held
    model.zero_grad(set_to_none=True)
    return out


def _hf_fwd_bwd(model, batch, micro: int, temperature: float) -> None:
    """Plain HF (no FSDP): forward+backward of the micro-batches with tight padding, log-prob loss."""
    from fusedrl.workers.logprob import micro_batches

    for mb in micro_batches(batch, micro):
        ids, mask, pos = mb.sequences()
        keep = mask.any(0)  # drop columns that are padding in every row
        first, last = int(keep.nonzero()[0]), int(keep.nonzero()[-1]) + 1
        logits = model(
            input_ids=ids[:, first:last], attention_mask=mask[:, first:last], position_ids=pos[:, first:last]
        ).logits
        lp = torch.log_softmax(logits.float() / temperature, -1)
        lp.sum().backward()
    model.zero_grad(set_to_none=True)


def role_settings(
    path: str,
    param_dtype: str | None,
    attn: str = "auto",
    micro: int = 8,
    packed: bool = False,
    compiled: bool = False,
    share: bool = True,
    log_prob_micro: int = 16,
) -> tuple[Any, Any, Any]:
    """(model, actor, ref) configs as a fused worker gets them (typed): the YAML's defaults with the
    benchmark's shape on top, so every key the roles read is there and has the user's default."""
    from fusedrl.config import role_configs_from_overrides

    overrides = [
        f"actor_rollout_ref.model.path={path}",
        "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ROWS // 4}",  # prompts: the whole batch, one step
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={log_prob_micro}",
        f"actor_rollout_ref.model.attn_implementation={attn}",
        f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
        f"actor_rollout_ref.model.compile_layers={str(compiled).lower()}",
        f"actor_rollout_ref.model.share_prompt_prefix={str(share).lower()}",
    ]
    for role in ("actor", "ref"):  # always named: the default (auto) would be bf16 on a native-bf16 CPU
        overrides.append(f"actor_rollout_ref.{role}.fsdp_config.param_dtype={param_dtype or 'null'}")
    cfg = role_configs_from_overrides(overrides)
    return cfg.model, cfg.actor, cfg.ref


@contextlib.contextmanager
def _plain_weight_grads(plain: bool):
    """With ``plain``, compiled layers keep ``nn.Linear``'s own weight gradient (the ``_plaingrad``
    variants) instead of `fusedrl.workers.layer_compile.RowMajorGradLinear`."""
    import fusedrl.workers.layer_compile as layer_compile

    kept = layer_compile.use_row_major_weight_grads
    if plain:
        layer_compile.use_row_major_weight_grads = lambda module: 0
    try:
        yield
    finally:
        layer_compile.use_row_major_weight_grads = kept


def _rank_main(rank: int, world: int, threads: int, port: int, args: dict, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args["bind"]:  # each rank on cores of its own, as a fused worker
        from fusedrl.utils.hardware import bind_process_cpus, slot_cpu_sets

        sets = slot_cpu_sets([world], threads, os.sched_getaffinity(0))
        if sets:
            bind_process_cpus(sets[0][rank])
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _measure(rank, world, args, out)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, args: dict, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import fusedrl.workers.fsdp as fsdp
    import fusedrl.workers.logprob as logprob
    from benchmarks.common import model_dir
    from fusedrl.workers.actor import ActorRole, RefRole

    path = model_dir(args["preset"])
    model_cfg, actor_cfg, ref_cfg = role_settings(
        path, args["param_dtype"], micro=args["micro"], log_prob_micro=args["log_prob_micro"]
    )
    roles = {"base": (ActorRole(model_cfg, actor_cfg, rollout_n=4), RefRole(model_cfg, ref_cfg))}
    for variant, (dtype, attn, packed, compiled) in {
        "packed": (args["param_dtype"], "auto", True, False),
        "compiled": (args["param_dtype"], "auto", False, True),
        "packed_compiled": (args["param_dtype"], "auto", True, True),
        "bf16": ("bfloat16", "auto", False, False),
        "bf16_sdpa": ("bfloat16", "sdpa", False, False),
        "bf16_packed": ("bfloat16", "auto", True, False),
        "bf16_compiled": ("bfloat16", "auto", False, True),
        "bf16_packed_compiled": ("bfloat16", "auto", True, True),
    }.items():
        for base_name, share in ((variant, True), (f"{variant}_unshared", False)):
            for name, plain in ((base_name, False), (f"{base_name}_plaingrad", True)):
                if name in args["variants"] or f"{name}_gloo" in args["variants"]:
                    bm, ba, br = role_settings(
                        path, dtype, attn, args["micro"], packed, compiled, share, args["log_prob_micro"]
                    )
                    with _plain_weight_grads(plain):
                        roles[name] = (ActorRole(bm, ba, rollout_n=4), RefRole(bm, br))
    actor, ref = roles["base"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    full = synthetic_batch(args["response_length"], samples_per_prompt=args["samples_per_prompt"])
    rows = ROWS // world
    shard = full[rank * rows : (rank + 1) * rows]
    counted = _count_flops(hf, shard, args["micro"])
    temperature = 1.0

    # A batch of other lengths, passed through every variant's roles before the timed passes: a compiled
    # layer then runs its dynamic graph in the timed passes, as in every step of a run after the first.
    other = synthetic_batch(args["response_length"], seed=1, samples_per_prompt=args["samples_per_prompt"])
    other = other[rank * rows : (rank + 1) * rows]

    def old(batch=shard):
        return actor.compute_log_prob(batch, temperature=temperature, micro_batch_size=args["log_prob_micro"])

    def run_ref(batch=shard):
        return ref.compute_log_prob(batch, temperature=temperature)

    def update(batch=shard, log_probs=None):  # log_probs: (old, ref) of ``batch``; default the shard's
        b = batch.clone()
        b.old_log_probs, b.ref_log_probs = log_probs or (old_lp, ref_lp)
        actor.update(b, temperature=temperature)

    current = {"variant": "base"}

    def hf_pass():  # a bf16 variant's plain HF pass runs under bf16 autocast, as TRL's bf16 mode does
        bf16 = current["variant"].startswith("bf16")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _hf_fwd_bwd(hf, shard, args["micro"], temperature)

    old_lp, ref_lp = old(), run_ref()
    variants = args["variants"]
    defaults = {"trim": logprob.TRIM_PADDING, "once": fsdp.GATHER_ONCE_PER_PASS}

    def apply(variant: str) -> None:
        nonlocal actor, ref
        logprob.TRIM_PADDING = defaults["trim"] and variant != "no_trim"
        fsdp.GATHER_ONCE_PER_PASS = defaults["once"] and variant != "regather"
        os.environ["FUSEDRL_SHM_COLLECTIVES"] = "0" if variant.endswith("gloo") else "1"
        same_roles = variant.removesuffix("_gloo").removesuffix("gloo") or "base"  # gloo: base's roles
        actor, ref = roles[same_roles if same_roles in roles else "base"]
        current["variant"] = variant

    phases = {"old_log_prob": old, "ref": run_ref, "update": update, "hf_fwd_bwd": hf_pass}
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in phases} for v in variants}
    ceilings: dict[str, list[float]] = {name: [] for name in args["ceiling_dtypes"]}
    warmup: dict[str, float] = {}  # the first passes of each variant: compiles, if any, happen here
    for variant in variants:
        apply(variant)
        dist.barrier()
        t0 = time.perf_counter()
        update(other, (old(other), run_ref(other)))
        old(), run_ref(), update()
        dist.barrier()
        warmup[variant] = time.perf_counter() - t0
    for _ in range(args["reps"]):
        for variant in variants:
            apply(variant)
            for name, fn in phases.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[variant][name].append(time.perf_counter() - t0)
        # The ceiling in the same processes, threads and load as the passes (every rank at once, as they run)
        for dt_name in ceilings:
            dist.barrier()
            ceilings[dt_name].append(matmul_ceiling(getattr(torch, dt_name), reps=3))
    profiles = {}
    if args["profile"]:
        from torch.profiler import ProfilerActivity, profile

        for variant in variants:
            apply(variant)
            for name, fn in phases.items():
                shapes = bool(os.environ.get("PROFILE_SHAPES"))  # group the table by input shapes
                with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
                    fn()
                profiles[f"{variant}/{name}"] = prof.key_averages(group_by_input_shape=shapes).table(
                    sort_by="self_cpu_time_total",
                    row_limit=args["top"],
                    max_name_column_width=int(os.environ.get("PROFILE_NAME_WIDTH", "40")),
                )
    apply("base")
    if rank == 0:
        result = {
            "world": world,
            "threads": torch.get_num_threads(),
            "fwd_gflop_per_rank": counted["fwd"] / 1e9,
            "fwd_bwd_gflop_per_rank": counted["fwd_bwd"] / 1e9,
            "fwd_gflop_held_per_rank": counted["fwd_held"] / 1e9,
            "fwd_bwd_gflop_held_per_rank": counted["fwd_bwd_held"] / 1e9,
            "times": times,
            "warmup_s": warmup,
            "ceiling_gflops_per_rank": ceilings,
            "profiles": profiles,
        }
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


def run_layout(world: int, threads: int, args: dict) -> dict:
    import torch.multiprocessing as mp

    from benchmarks.common import model_dir

    model_dir(args["preset"])  # built once here: ranks building it at once read a half-written folder
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_main, args=(world, threads, _free_port(), args, out), nprocs=world, join=True)
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1x2,2x1")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8, help="update micro-batch rows per worker")
    ap.add_argument(
        "--log-prob-micro-batch",
        type=int,
        default=16,
        help="old-log-prob and reference micro-batch rows per worker (trl_side_by_side: the whole shard)",
    )
    ap.add_argument("--variants", default="base")
    ap.add_argument("--param-dtype", default=None)
    ap.add_argument(
        "--samples-per-prompt", type=int, default=1, help="rows sharing a prompt (GRPO's n; 1: all distinct)"
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    from fusedrl.controller.placement import BIND_ENV  # here, not at the top: the spawned ranks need no Ray

    args = {
        "preset": a.preset,
        "response_length": a.response_length,
        "reps": a.reps,
        "micro": a.micro_batch,
        "log_prob_micro": a.log_prob_micro_batch,
        "variants": a.variants.split(","),
        "param_dtype": a.param_dtype,
        "samples_per_prompt": a.samples_per_prompt,
        "profile": a.profile,
        "top": a.top,
        "bind": os.environ.get(BIND_ENV, "1") != "0",
    }
    from benchmarks.common import record
    from fusedrl.trainer.runtime import tcmalloc_preload
    from fusedrl.utils.hardware import native_bf16

    args["ceiling_dtypes"], bf16_note = ceiling_dtypes(a.param_dtype, args["variants"], native_bf16()[0])
    # The ranks get the allocator a fused worker gets (tcmalloc where the machine has it; glibc's malloc
    # faults large activation buffers back in on every allocation: 8-9% of a bf16 update here).
    if "tcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = tcmalloc_preload() or os.environ.get("LD_PRELOAD", "")
    allocator = "tcmalloc" if "tcmalloc" in os.environ["LD_PRELOAD"] else "glibc malloc"
    binding = "each rank bound to cores of its own" if args["bind"] else "unbound"

    rows, payload, prof_text = [], {"layouts": {}}, []
    ceil_text = []
    for layout in a.layouts.split(","):
        world, threads = (int(x) for x in layout.split("x"))
        res = run_layout(world, threads, args)
        print(f"LAYOUT {layout} " + json.dumps({k: v for k, v in res.items() if k != "profiles"}), flush=True)
        payload["layouts"][layout] = res
        flops = {"old_log_prob": res["fwd_gflop_per_rank"], "ref": res["fwd_gflop_per_rank"]}
        flops["update"] = flops["hf_fwd_bwd"] = res["fwd_bwd_gflop_per_rank"]
        ceil = {k: statistics.median(v) / threads for k, v in res["ceiling_gflops_per_rank"].items()}
        bf16_text = f"bf16 {ceil['bfloat16']:.0f}" if "bfloat16" in ceil else bf16_note
        ceil_text.append(f"{layout}: fp32 {ceil['float32']:.0f}, {bf16_text}")
        for variant, per_phase in res["times"].items():
            cells = []
            for phase in PHASES:
                t = statistics.median(per_phase[phase])
                rate = flops[phase] / t / threads  # GFLOP/s per thread, all ranks run alike
                cells.append(f"{t:.2f} s ({rate:.0f})")
            bf16 = variant.startswith("bf16") or a.param_dtype in ("bfloat16", "bf16")
            dtype = "bfloat16" if bf16 else (a.param_dtype or "float32")
            train = ("old_log_prob", "ref", "update")
            rate = (
                sum(flops[p] for p in train) / sum(statistics.median(per_phase[p]) for p in train) / threads
            )
            if dtype in ceil:
                share = f"{rate:.0f} = {100 * rate / ceil[dtype]:.0f}% of {dtype} {ceil[dtype]:.0f}"
            else:
                share = f"{rate:.0f} (no {dtype} ceiling measured)"
            if a.samples_per_prompt > 1 and "_unshared" not in variant and "packed" in variant:
                held = {"old_log_prob": res["fwd_gflop_held_per_rank"], "ref": res["fwd_gflop_held_per_rank"]}
                held["update"] = res["fwd_bwd_gflop_held_per_rank"]
                executed = sum(held.values()) / sum(statistics.median(per_phase[p]) for p in train) / threads
                share += f"; executed {executed:.0f}" + (
                    f" = {100 * executed / ceil[dtype]:.0f}%" if dtype in ceil else ""
                )
            warm = f"{res['warmup_s'][variant]:.1f}"
            rows.append(f"| {layout} | {variant} | " + " | ".join(cells) + f" | {share} | {warm} |")
        for key, table in res["profiles"].items():
            prof_text.append(
                f"**{layout} {key}** (rank 0, top {a.top} by self CPU time)\n\n```\n{table}\n```"
            )
    dtype = a.param_dtype or "float32"
    header = (
        "| WxT | variant | "
        + " | ".join(f"{p} s (GFLOP/s/thread)" for p in PHASES)
        + " | training passes GFLOP/s/thread vs ceiling | warm-up s |"
    )
    table = "\n".join(
        [
            f"Training passes, {a.preset} model, {ROWS} samples ({a.samples_per_prompt} per prompt), prompts 15-35 "
            f"tokens left-padded to {TP}, responses "
            f"<= {a.response_length} ({dtype} compute); median of {a.reps}. FLOPs: real tokens only "
            f"(torch.utils.flop_counter), every sample's whole sequence: with shared prompts (variants without "
            f'`_unshared`, several samples per prompt) the rates are of the unshared work, and "executed" counts the work the '
            f"shared rows hold (linears on the tokens held, attention as unshared). Matmul ceiling (2048x512 @ 512x1408), GFLOP/s per thread, "
            f"measured in the same worker processes between the rounds, all ranks at once: "
            f"{'; '.join(ceil_text)} ({native_bf16()[1]}). Allocator of the ranks: {allocator}; {binding}.",
            "",
            header,
            "|" + "---|" * (len(PHASES) + 4),
            *rows,
        ]
    )
    if prof_text:
        table += (
            "\n\n<details><summary>profiler tables</summary>\n\n" + "\n\n".join(prof_text) + "\n</details>"
        )
    payload["layouts"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "profiles"} for k, v in payload["layouts"].items()
    }
    cmd = (
        f"python -m benchmarks.train_passes --layouts {a.layouts} --preset {a.preset} --response-length "
        f"{a.response_length} --reps {a.reps} --micro-batch {a.micro_batch} --log-prob-micro-batch {a.log_prob_micro_batch} --variants {a.variants} "
        f"--samples-per-prompt {a.samples_per_prompt}"
        + (f" --param-dtype {a.param_dtype}" if a.param_dtype else "")
        + (" --profile" if a.profile else "")
    )
    if a.no_record:
        print(table)
        print("JSON " + json.dumps(payload))
    else:
        record("Training passes", cmd, table, payload)


if __name__ == "__main__":
    main()
