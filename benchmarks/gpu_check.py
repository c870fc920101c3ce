"""The prepared GPU check: the CUDA path of a fused worker, in one short run, with one JSON summary.

Run it with ``scripts/gpu_check.sh`` (see docs/gpu.md). It targets a bare GPU machine: Python, torch with
CUDA, transformers; no Ray, no vLLM, no hydra / omegaconf, no network. So it drives `WorkerDict` in-process
(world size 1, the HF rollout) without Ray, builds its config from the YAML defaults without omegaconf,
and imports tensordict (and its two small pure-Python dependencies) from the wheels vendored in
``scripts/gpu_wheels/``. Each model runs in its own child process (a fresh CUDA context and process group).

Per model (presets ``small``, ``mid`` and ``half_b``, a Qwen2.5-0.5B-shaped decoder; ``half_b+packed`` and
``half_b+packed+compiled`` set `benchmarks.gpu_check_config.VARIANTS`' keys on top; ``+vllm`` runs the vLLM
rollout instead of the HF one, where vLLM is installed: ``gpu_check.sh --vllm`` runs it) it shows:

* ``grpo_step``: two GRPO steps (three compiled) (rollout, old and reference log-probs, actor update) train with
  FSDP2 on NCCL in bfloat16 (mixed precision over float32 master weights): every parameter changes in each
  step, the loss and grad norm are finite, the rollout's log-probs of its samples are within the trainer's
  rollout-check bound of the actor's (with vLLM: after the actor's shards streamed into the engine in place,
  as the driver's weight sync does before each rollout); per-phase times, tokens/s and (on CUDA) model FLOP
  rates against the GPU's bf16 matmul rate are recorded;
* ``offload_bit_identical``: the actor's parameters and AdamW state offloaded and reloaded are bit-identical;
* ``device_memory_regained``: after the offload the device's free memory (``mem_get_info``) grew by at least
  90% of the offloaded training state;
* ``pinned_host_ratio``: page-locked host bytes (our buffers plus any growth of PyTorch's caching host
  allocator) are at most 1.1x the offloaded bytes;
* ``allocator_options_survive``: the allocator settings string is the same after the run as before.

``--dry-run`` (automatic without CUDA) runs the same code on the CPU with gloo and float32, blocks the
modules the GPU machine lacks (so a missing dependency shows up here), and marks each check that needs
CUDA as skipped, saying why.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_config import check_overrides, compiles_layers, resolved_config, split_variants

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "scripts" / "gpu_wheels"
MISSING_ON_GPU_MACHINE = ("ray", "vllm", "hydra", "omegaconf")
GPU_PRESETS = ("small", "mid", "half_b", "half_b+packed", "half_b+packed+compiled")
DRY_PRESETS = ("tiny", "tiny+packed+compiled")
# The first step pays the CUDA / cuBLAS warm-up (and, with compiled layers, the first compiles); the last is the
# one reported. Compiled layers recompile once more on the second step's other lengths (dynamic shapes), so a
# compiled model runs a third step, the first warm one (on an H200 its second step still compiled: 2026-12-04).
STEPS = 2
STEPS_COMPILED = 3


# ---------------------------------------------------------------------- imports on a bare machine
class _Blocker(importlib.abc.MetaPathFinder):
    """Makes the modules the GPU machine lacks unimportable here too (dry run); ``allowed`` ones excepted."""

    def __init__(self, allowed: tuple[str, ...] = ()) -> None:
        self.allowed = allowed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in MISSING_ON_GPU_MACHINE and name.split(".")[0] not in self.allowed:
            raise ImportError(f"{name} is blocked: the GPU machine has no {name.split('.')[0]}")
        return None


def _stand_in_for_ray() -> None:
    """WorkerDict's health hooks mark two methods with ``@ray.method(concurrency_group=...)``, which only
    matters to a Ray actor; without Ray (this check calls WorkerDict directly) the decorator does nothing."""
    import types

    ray = types.ModuleType("ray")
    ray.method = lambda **_: lambda fn: fn  # type: ignore[attr-defined]
    ray.__fusedrl_gpu_check_stand_in__ = True  # type: ignore[attr-defined]
    sys.modules["ray"] = ray


def allowed_imports(presets: list[str]) -> tuple[str, ...]:
    """The modules a run needs although a bare GPU machine lacks them: vLLM (and the Ray it brings) for
    ``+vllm`` models, whose check runs only where vLLM is installed."""
    return ("vllm", "ray") if any("vllm" in p.split("+")[1:] for p in presets) else ()


def prepare_imports(*, block_missing: bool, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """Vendored wheels first on ``sys.path``; ``fusedrl.workers`` importable without an install."""
    if block_missing and not any(isinstance(f, _Blocker) for f in sys.meta_path):
        sys.meta_path.insert(0, _Blocker(allowed))
    deps = Path(tempfile.gettempdir()) / "fusedrl_gpu_check_deps"
    for wheel in sorted(WHEELS.glob("*.whl")):
        target = deps / wheel.stem
        if not target.exists():
            tmp = deps / f".{wheel.stem}.{os.getpid()}"
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
            os.replace(tmp, target)
        if str(target) not in sys.path:
            sys.path.insert(0, str(target))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if (block_missing and "ray" not in allowed) or importlib.util.find_spec("ray") is None:
        _stand_in_for_ray()
    import fusedrl

    if importlib.util.find_spec("fusedrl.workers") is None:
        # Not installed: the repository's top-level workers/ trainer/ third_party/ are fusedrl subpackages.
        fusedrl.__path__.append(str(ROOT))
    import tensordict

    return {
        "fusedrl": str(Path(fusedrl.__file__).parent),
        "tensordict": str(Path(tensordict.__file__).parent),
    }


# ---------------------------------------------------------------------- one model (child process)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(ok: bool | None, *, skipped: str | None = None, **values: Any) -> dict[str, Any]:
    return {"ok": None if skipped else bool(ok), **({"skipped": skipped} if skipped else {}), **values}


def _prompts(tok, n_prompts: int, n: int):
    from fusedrl.batch import RolloutBatch

    texts = [f"What is {3 * i + 1} + {7 * i + 2}? Think step by step." for i in range(n_prompts)]
    encoded = [tok.encode(t) for t in texts]
    width = max(len(e) for e in encoded)
    import torch

    prompts = torch.full((n_prompts, width), tok.pad_token_id, dtype=torch.long)  # [P, Tp]
    mask = torch.zeros_like(prompts)  # [P, Tp]
    for i, e in enumerate(encoded):
        prompts[i, width - len(e) :] = torch.tensor(e)
        mask[i, width - len(e) :] = 1
    batch = RolloutBatch.from_prompts(
        prompts,
        mask,
        uid=[str(i) for i in range(n_prompts)],
        data_source=["check"] * n_prompts,
        ground_truth=["0"] * n_prompts,
    ).repeat_samples(n)
    batch.sample_seeds = torch.arange(batch.num_samples, dtype=torch.long) * 7919 + 1
    return batch


def _state_copy(model, optimizer) -> tuple[dict[str, Any], list[Any]]:
    from fusedrl.workers.memory import optimizer_state_tensors

    params = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    optim = [
        (t.to_local() if hasattr(t, "to_local") else t).cpu().clone()
        for t in optimizer_state_tensors(optimizer)
    ]
    return params, optim


def run_model(name: str, *, dry_run: bool, workdir: str) -> dict[str, Any]:
    """Build one model, start a fused worker on it, run two or three GRPO steps and an offload round trip."""
    import torch
    import torch.distributed as dist

    from fusedrl.role_config import TokenIds, build_role_configs
    from fusedrl.utils.tiny_model import build_tiny_model, count_parameters
    from fusedrl.workers.memory import Offloader, allocator_settings, device_free_total, empty_cache
    from fusedrl.workers.worker_dict import WorkerDict

    cuda = torch.cuda.is_available() and not dry_run
    no_cuda = "needs CUDA (dry run on CPU)" if not cuda else None
    n_prompts, n, response_length = (16, 4, 128) if cuda else (2, 2, 8)
    preset, variant_overrides = split_variants(name)
    out: dict[str, Any] = {"preset": preset, "variant_overrides": variant_overrides}
    t0 = time.perf_counter()
    model_dir = build_tiny_model(os.path.join(workdir, preset), preset=preset, seed=0)
    out["parameters"] = count_parameters(model_dir)
    out["build_s"] = time.perf_counter() - t0

    overrides = check_overrides(model_dir, cuda=cuda, response_length=response_length, n=n)
    cfg = resolved_config(overrides + variant_overrides)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = build_role_configs(cfg, tokens=TokenIds(eos=int(tok.eos_token_id), pad=int(tok.pad_token_id)))
    alloc_before = allocator_settings()
    worker = WorkerDict(cfg, rank=0, world_size=1, roles=("actor", "rollout", "ref"))
    t0 = time.perf_counter()
    init = worker.init_roles("127.0.0.1", _free_port())
    out["init_s"] = time.perf_counter() - t0
    out["backend"] = dist.get_backend()
    try:
        steps = []
        for _ in range(STEPS_COMPILED if compiles_layers(name) else STEPS):
            steps.append(_grpo_step(worker, _prompts(tok, n_prompts, n), response_length, cuda=cuda))
        out.update(steps[-1])  # the warm step's figures; every step must pass
        out["steps"] = [{k: v for k, v in st.items() if k != "checks"} for st in steps]
        step_checks = [st["checks"]["grpo_step"] for st in steps]
        out["checks"]["grpo_step"] = {
            **step_checks[-1],
            "ok": all(c["ok"] for c in step_checks),
            "per_step_ok": [c["ok"] for c in step_checks],
        }
        if cuda:
            out["model_flop_rates"] = _flop_rates(out["parameters"], steps[-1])
        out["checks"]["nccl"] = (
            _check(out["backend"] == "nccl", backend=out["backend"])
            if cuda
            else _check(None, skipped="NCCL " + str(no_cuda), backend=out["backend"])
        )
        out["memory_init"] = {k: v for k, v in init.items() if k.startswith("memory/")}
        out["memory_rollout"] = dict(worker.last_rollout_memory)

        # Offload round trip of the actor's parameters and AdamW state, from fully resident.
        assert worker.actor is not None and worker.actor_mem is not None
        worker.actor_mem.load_all()
        model, optimizer = worker.actor.model, worker.actor.optimizer
        params, optim = _state_copy(model, optimizer)
        mem = Offloader("check", model, optimizer, param_offload=True, optimizer_offload=True, events=[])
        mem.use_host_buffers = True  # on CPU: the same packing, without page-locking
        empty_cache()
        free0 = device_free_total()
        host0 = _caching_host_reserved() if cuda else 0
        mem.offload_all()
        empty_cache()
        free1 = device_free_total()
        pinned_growth = (_caching_host_reserved() - host0) if cuda else 0
        all_pinned = cuda and all(p.to_local().is_pinned() for p in model.parameters())
        host_bytes = mem.host_bytes()
        state_bytes = mem.offloaded_bytes
        mem.load_all()
        params2, optim2 = _state_copy(model, optimizer)
        identical = (
            all(torch.equal(params[k], params2[k]) for k in params)
            and len(optim) == len(optim2)
            and all(torch.equal(a, b) for a, b in zip(optim, optim2))
        )
        checks = out["checks"]
        checks["offload_bit_identical"] = _check(
            identical and len(optim) > 0, params=len(params), optimizer_tensors=len(optim)
        )
        if free0 is not None and free1 is not None:
            regained = free1[0] - free0[0]
            checks["device_memory_regained"] = _check(
                regained >= 0.9 * state_bytes,
                regained_bytes=regained,
                state_bytes=state_bytes,
                fraction=regained / max(state_bytes, 1),
                limit=0.9,
            )
        else:
            checks["device_memory_regained"] = _check(None, skipped="mem_get_info " + str(no_cuda))
        ratio = (host_bytes + max(pinned_growth, 0)) / max(state_bytes, 1)
        checks["pinned_host_ratio"] = _check(
            ratio <= 1.1 and (all_pinned or not cuda),
            ratio=ratio,
            host_buffer_bytes=host_bytes,
            caching_host_growth_bytes=pinned_growth,
            state_bytes=state_bytes,
            limit=1.1,
            all_pinned=all_pinned,
            **(
                {"note": "host buffers not page-locked on CPU; ratio of the packing only"} if not cuda else {}
            ),
        )
        alloc_after = allocator_settings()
        wanted = [f for f in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if f]
        checks["allocator_options_survive"] = (
            _check(
                alloc_after == alloc_before and all(f in alloc_after or not alloc_after for f in wanted),
                before=alloc_before,
                after=alloc_after,
                requested=wanted,
            )
            if cuda
            else _check(None, skipped="allocator settings " + str(no_cuda))
        )
    finally:
        dist.destroy_process_group()
    return out


def _caching_host_reserved() -> int:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return 0
    return int(stats().get("reserved_bytes.current", stats().get("allocated_bytes.current", 0)))


def _now(cuda: bool) -> float:
    import torch

    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def matmul_ceiling(n: int = 8192, reps: int = 10) -> float:
    """Dense bf16 matmul rate of this GPU in TFLOP/s (``[n, n] @ [n, n]``, mean of ``reps`` after 3 warm-ups)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t0 = _now(True)
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (_now(True) - t0) / 1e12


def _flop_rates(parameters: int, step: dict[str, Any]) -> dict[str, Any]:
    """Model FLOP rates of the warm step's training passes (2 FLOPs per parameter and token forward, 6
    forward + backward; attention's own products not counted) against the bf16 matmul ceiling."""
    ceiling = matmul_ceiling()
    fwd = 2.0 * parameters * step["tokens"]  # real prompt + response tokens (padding is not useful work)
    rates = {
        "old_log_prob": fwd / step["old_log_prob_s"] / 1e12,
        "ref": fwd / step["ref_s"] / 1e12,
        "update": 3 * fwd / step["update_s"] / 1e12,
    }
    return {
        "ceiling_bf16_tflop_s": ceiling,
        **{f"{k}_tflop_s": v for k, v in rates.items()},
        **{f"{k}_of_ceiling": v / ceiling for k, v in rates.items()},
    }


def _grpo_step(worker, batch, response_length: int, *, cuda: bool) -> dict[str, Any]:
    import torch

    from fusedrl.algorithms import get_adv_estimator
    from fusedrl.workers.rollout.base import SamplingConfig, log_prob_gap_bound
    from fusedrl.workers.rollout.hf_rollout import HFRollout

    temperature = 1.0
    seen_dtypes: set[str] = set()
    # On the decoder layer (its FSDP2 gather has run when this hook fires), not inside it: a compiled
    # layer's insides run as one graph.
    layer = worker.actor.model.model.layers[0]
    hook = layer.register_forward_pre_hook(
        lambda mod, args: seen_dtypes.add(str(mod.self_attn.q_proj.weight.dtype))
    )
    before = worker.actor_state()
    t0 = _now(cuda)
    streams = not isinstance(worker.rollout, HFRollout)  # vLLM: its own copy of the weights
    sync: dict[str, float] = {}
    if streams:
        # The driver's sync_weights before a rollout: the engine slept once built (level 2 threw its weights
        # away) and holds the weights before the last update; the actor's shards stream into it in place.
        worker.prepare_weight_update()
        worker.load_actor()
        worker.rollout_wake_up(["weights"])
        sync = worker.update_weights()
        worker.offload_actor(params=True, optimizer=False)
    t_sync = _now(cuda) - t0
    # The driver's moves of one step (PPOTrainer.generate / compute_*_log_probs / update_actor), in order.
    worker.rollout_wake_up(["weights", "kv_cache"])
    out = worker.rollout_generate(
        batch.select_fields("prompts", "prompt_mask", "sample_seeds"),
        SamplingConfig(max_tokens=response_length, temperature=temperature),
    )
    worker.rollout_sleep()
    worker.load_actor()
    t_gen = time.perf_counter() - t0 - t_sync
    batch.update_from(out, "responses", "response_mask", "rollout_log_probs")
    inputs = batch.select_fields("prompts", "prompt_mask", "responses", "response_mask")
    phases: dict[str, float] = {}
    t1 = _now(cuda)
    batch.old_log_probs = worker.actor_compute_log_prob(inputs, temperature)
    phases["old_log_prob_s"] = _now(cuda) - t1
    # The engine's log-probs of its own samples against the actor's (the trainer's rollout check): a sync
    # that did not land, or an engine that computes another model, is off by order 1.
    resp = batch.response_mask.bool()
    gap = float((batch.rollout_log_probs - batch.old_log_probs)[resp].abs().mean())
    engine_dtype = {str(worker.rollout.param_dtype())} if streams else set()  # HF: the actor's own module
    gap_tol = log_prob_gap_bound({d.removeprefix("torch.") for d in engine_dtype | seen_dtypes})
    worker.load_ref()
    t1 = _now(cuda)
    batch.ref_log_probs = worker.ref_compute_log_prob(inputs, temperature)
    phases["ref_s"] = _now(cuda) - t1
    worker.offload_ref()
    # A reward that varies within each group: the share of even token ids, on the last response token.
    mask = batch.response_mask.float()  # [B, Tr]
    score = ((batch.responses % 2 == 0).float() * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    last = (batch.response_mask.sum(1) - 1).clamp(min=0)  # [B]
    rewards = torch.zeros_like(mask)  # [B, Tr]
    rewards[torch.arange(len(last)), last] = score
    adv, _ = get_adv_estimator("grpo")(
        rewards, batch.response_mask, index=batch.field_list("uid"), norm_adv_by_std_in_grpo=True
    )
    batch.advantages = adv
    update_in = batch.select_fields(
        "prompts", "prompt_mask", "responses", "response_mask", "old_log_probs", "advantages", "ref_log_probs"
    )
    worker.load_actor(optimizer=True)
    t1 = _now(cuda)
    metrics = worker.actor_update(update_in, temperature)
    phases["update_s"] = _now(cuda) - t1
    worker.offload_actor(params=False, optimizer=True)
    step_s = _now(cuda) - t0
    hook.remove()
    after = worker.actor_state()
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    finite = all(math.isfinite(v) for k, v in metrics.items() if k.startswith("actor/"))
    tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    compute = "torch.bfloat16" if cuda else "torch.float32"
    return {
        "checks": {
            "grpo_step": _check(
                len(changed) == len(before)
                and finite
                and seen_dtypes == {compute}
                and worker.rollout is not None
                and gap_tol is not None
                and gap <= gap_tol,
                rollout="vllm" if streams else "hf",
                rollout_vs_actor_log_prob_gap=gap,
                gap_tol=gap_tol,
                synced_tensors=sync.get("sync/num_tensors"),
                changed_tensors=len(changed),
                tensors=len(before),
                metrics_finite=finite,
                compute_dtypes=sorted(seen_dtypes),
                expected_compute_dtype=compute,
            ),
        },
        "step_s": step_s,
        "sync_s": t_sync,
        "generate_s": t_gen,
        **phases,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "response_tokens_per_s": float(batch.response_mask.sum()) / t_gen,
        "samples": batch.num_samples,
        "update_metrics": {k: v for k, v in metrics.items() if not k.startswith("memory/cpu")},
    }


# ---------------------------------------------------------------------- orchestration
def _device() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = "cpu (no CUDA)"
    return info


def _print_model(name: str, m: dict[str, Any]) -> None:
    if "error" in m:
        print(f"  {name}: ERROR {m['error']}\n{m['stderr_tail']}", flush=True)
        return
    line = ", ".join(
        f"{k}={'skip' if c['ok'] is None else ('ok' if c['ok'] else 'FAIL')}" for k, c in m["checks"].items()
    )
    print(
        f"  {name} ({m['parameters'] / 1e6:.1f}M): {line}; warm step {m['step_s']:.2f} s "
        f"(first {m['steps'][0]['step_s']:.2f} s; generate {m['generate_s']:.2f}, old log-prob "
        f"{m['old_log_prob_s']:.3f}, ref {m['ref_s']:.3f}, update {m['update_s']:.3f} s), "
        f"{m['tokens_per_s']:.0f} tok/s; child {m['wall_s']:.0f} s",
        flush=True,
    )
    if "model_flop_rates" in m:
        r = m["model_flop_rates"]
        print(
            f"    model TFLOP/s (bf16 matmul ceiling {r['ceiling_bf16_tflop_s']:.0f}): old log-prob "
            f"{r['old_log_prob_tflop_s']:.1f}, ref {r['ref_tflop_s']:.1f}, update {r['update_tflop_s']:.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU run: skip (and say so) what needs CUDA")
    p.add_argument(
        "--presets", default=None, help=f"comma list (GPU: {','.join(GPU_PRESETS)}; dry run: tiny)"
    )
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per model")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    presets = args.presets.split(",") if args.presets else list(DRY_PRESETS if dry else GPU_PRESETS)
    allowed = allowed_imports([args.child] if args.child else presets)
    imports = prepare_imports(block_missing=dry, allowed=allowed)
    if args.child:
        with tempfile.TemporaryDirectory() as workdir:
            result = run_model(args.child, dry_run=dry, workdir=workdir)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0

    if dry and not args.dry_run:
        print(
            "gpu_check: no CUDA device here: dry run on the CPU (checks that need CUDA are skipped)",
            flush=True,
        )
    summary: dict[str, Any] = {
        "dry_run": dry,
        **_device(),
        "imports": imports,
        "blocked_modules": [m for m in MISSING_ON_GPU_MACHINE if m not in allowed] if dry else [],
        "allocator_conf_env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "models": {},
    }
    t0 = time.perf_counter()
    for preset in presets:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            part = f.name
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", preset, "--out", part]
        cmd += ["--dry-run"] if dry else []
        print(f"gpu_check: {preset} ...", flush=True)
        t_model = time.perf_counter()
        try:
            # Compiling the layers (Inductor / Triton) costs minutes more than an eager model's run.
            timeout = args.timeout * (3 if compiles_layers(preset) else 1)
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            if proc.returncode == 0:
                summary["models"][preset] = json.loads(Path(part).read_text())
            else:
                summary["models"][preset] = {
                    "error": f"exit {proc.returncode}",
                    "stderr_tail": proc.stderr[-4000:],
                }
        except subprocess.TimeoutExpired as err:
            summary["models"][preset] = {
                "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": str(err.stderr or "")[-4000:],
            }
        finally:
            os.unlink(part)
        summary["models"][preset]["wall_s"] = time.perf_counter() - t_model
        _print_model(preset, summary["models"][preset])
        Path(args.out).write_text(json.dumps(summary, indent=1))  # so far (a run cut short keeps it)
    summary["total_s"] = time.perf_counter() - t0
    results = [c for m in summary["models"].values() for c in m.get("checks", {}).values()]
    failed_models = [k for k, m in summary["models"].items() if "error" in m]
    summary["failed"] = failed_models + [
        f"{k}.{name}"
        for k, m in summary["models"].items()
        for name, c in m.get("checks", {}).items()
        if c["ok"] is False
    ]
    summary["skipped"] = sorted(
        {
            f"{name}: {c['skipped']}"
            for m in summary["models"].values()
            for name, c in m.get("checks", {}).items()
            if c["ok"] is None
        }
    )
    summary["passed"] = not summary["failed"] and any(c["ok"] for c in results)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    for s in summary["skipped"]:
        print(f"  skipped {s}")
    print(
        f"gpu_check: {'PASSED' if summary['passed'] else 'FAILED'} in {summary['total_s']:.0f} s -> {args.out}"
    )
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
