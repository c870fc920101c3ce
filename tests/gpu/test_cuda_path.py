"""The CUDA path of a fused worker: offload / reload, FSDP2 on NCCL, HF rollout on CUDA.

Marked ``gpu``: skipped where there is no CUDA device (see tests/conftest.py); run on a GPU machine with
``make test-gpu``. The last test runs the prepared check, ``scripts/gpu_check.sh`` (docs/gpu.md). Each test runs in a fresh spawned process with its own NCCL process group (world size 1,
GPU 0), so a CUDA context or a process group never leaks between tests. The model is the ``small`` preset
(~18M parameters): large enough that its training state dwarfs allocator noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support import free_port

pytestmark = pytest.mark.gpu


def _init_nccl(port: int) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def _entry(name: str, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    _init_nccl(port)
    try:
        result = globals()[name](model_dir)
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(name: str, model_dir: str, tmp_path: Path) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    out = tmp_path / f"{name}.json"
    proc = ctx.Process(target=_entry, args=(name, free_port(), model_dir, str(out)))
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0, f"{name} failed in its worker process (exit code {proc.exitcode})"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("small_model")), preset="small", seed=0)


def _train_setup(model_dir: str):
    from fusedrl.workers.fsdp import apply_fsdp2, build_mesh, load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(model_dir, "float32", "sdpa").cuda()
    apply_fsdp2(model, build_mesh())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), device="cuda")  # [B, T]
    return model, optimizer, ids


def _train_step(model, optimizer, ids) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return float(loss)


# ---------------------------------------------------------------------- worker-process bodies
def offload_roundtrip(model_dir: str) -> dict:
    from fusedrl.workers.memory import Offloader, optimizer_state_tensors

    model, optimizer, ids = _train_setup(model_dir)
    _train_step(model, optimizer, ids)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # gradients present, as right after an update
    mem = Offloader("actor", model, optimizer, param_offload=True, optimizer_offload=True, events=[])
    state_bytes = mem.training_state_bytes()
    params_before = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    optim_before = [
        t.to_local().cpu().clone() if hasattr(t, "to_local") else t.cpu().clone()
        for t in optimizer_state_tensors(optimizer)
    ]
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]

    mem.offload_all()
    torch.cuda.synchronize()
    allocated_offloaded = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    free_offloaded = torch.cuda.mem_get_info()[0]
    host_bytes, offloaded_bytes = mem.host_bytes(), mem.offloaded_bytes
    locals_ = [p.to_local() for p in model.parameters()]
    on_cpu = all(t.device.type == "cpu" for t in locals_)
    pinned = all(t.is_pinned() for t in locals_)
    moments = [t.to_local() if hasattr(t, "to_local") else t for t in optimizer_state_tensors(optimizer)]
    moments_on_cpu = all(t.device.type == "cpu" for t in moments)

    mem.load_all()
    torch.cuda.synchronize()
    params_after = {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}
    optim_after = [
        t.to_local().cpu() if hasattr(t, "to_local") else t.cpu() for t in optimizer_state_tensors(optimizer)
    ]
    params_equal = all(torch.equal(params_before[n], params_after[n]) for n in params_before)
    optim_equal = len(optim_before) == len(optim_after) and all(
        torch.equal(a, b) for a, b in zip(optim_before, optim_after)
    )
    loss_after = _train_step(model, optimizer, ids)  # training goes on from the reloaded state
    changed = any(
        not torch.equal(params_before[n], p.to_local().detach().cpu()) for n, p in model.named_parameters()
    )
    return {
        "state_bytes": state_bytes,
        "allocated_before": allocated_before,
        "allocated_offloaded": allocated_offloaded,
        "device_free_gained": free_offloaded - free_before,
        "host_bytes": host_bytes,
        "offloaded_bytes": offloaded_bytes,
        "params_on_cpu": on_cpu,
        "params_pinned": pinned,
        "moments_on_cpu": moments_on_cpu,
        "params_equal": params_equal,
        "optim_equal": optim_equal,
        "num_optim_tensors": len(optim_before),
        "loss_after": loss_after,
        "changed_after_step": changed,
        "device": torch.cuda.get_device_name(0),
    }


def fsdp2_nccl_trains(model_dir: str) -> dict:
    import torch.distributed as dist

    model, optimizer, ids = _train_setup(model_dir)
    losses = [_train_step(model, optimizer, ids) for _ in range(8)]
    return {
        "losses": losses,
        "backend": dist.get_backend(),
        "param_device": str(next(model.parameters()).device),
    }


def hf_rollout_on_cuda(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from fusedrl.batch import RolloutBatch
    from fusedrl.workers.rollout.base import SamplingConfig
    from fusedrl.workers.rollout.hf_rollout import HFRollout

    model, _, _ = _train_setup(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["1 + 2 =", "what is 3 + 4 ?", "9"]
    encoded = [tok.encode(t) for t in texts]
    tp = max(len(e) for e in encoded)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = torch.full((len(texts), tp), pad, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for i, e in enumerate(encoded):
        prompts[i, tp - len(e) :] = torch.tensor(e)
        mask[i, tp - len(e) :] = 1
    batch = RolloutBatch.from_prompts(
        prompts.cuda(),
        mask.cuda(),
        uid=[str(i) for i in range(3)],
        data_source=["t"] * 3,
        ground_truth=["0"] * 3,
    )
    rollout = HFRollout(model, max_response_length=12, eos_token_id=tok.eos_token_id, pad_token_id=pad)
    out = rollout.generate(batch, SamplingConfig(max_tokens=12, temperature=1.0))
    lp = out.rollout_log_probs[out.response_mask.bool()]
    return {
        "responses_shape": list(out.responses.shape),
        "num_tokens": int(out.response_mask.sum()),
        "log_probs_finite": bool(torch.isfinite(lp).all()),
        "log_probs_nonpositive": bool((lp <= 1e-5).all()),
        "device": str(out.responses.device),
    }


# ---------------------------------------------------------------------- tests
def test_offload_roundtrip_is_bit_identical_and_frees_the_device(small_model_dir, tmp_path):
    r = _run("offload_roundtrip", small_model_dir, tmp_path)
    assert r["params_on_cpu"] and r["moments_on_cpu"]
    assert r["params_pinned"], "offloaded shards should sit in pinned host memory"
    assert r["num_optim_tensors"] > 0
    assert r["params_equal"] and r["optim_equal"]
    freed = r["allocated_before"] - r["allocated_offloaded"]
    assert freed >= 0.9 * r["state_bytes"], r
    assert r["device_free_gained"] >= 0.9 * r["offloaded_bytes"], r  # the driver's view (mem_get_info)
    assert r["offloaded_bytes"] <= r["host_bytes"] <= 1.1 * r["offloaded_bytes"], r  # exactly-sized pinned
    assert r["changed_after_step"] and r["loss_after"] == r["loss_after"]  # finite, and training went on


def test_fsdp2_on_nccl_trains(small_model_dir, tmp_path):
    r = _run("fsdp2_nccl_trains", small_model_dir, tmp_path)
    assert r["backend"] == "nccl" and r["param_device"].startswith("cuda")
    losses = r["losses"]
    assert all(x == x for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses  # memorising one fixed batch


def test_hf_rollout_on_cuda(small_model_dir, tmp_path):
    r = _run("hf_rollout_on_cuda", small_model_dir, tmp_path)
    assert r["responses_shape"] == [3, 12]
    assert r["num_tokens"] > 0
    assert r["log_probs_finite"] and r["log_probs_nonpositive"]


def test_prepared_gpu_check_passes(tmp_path):
    """scripts/gpu_check.sh end to end (small, mid, half_b): see docs/gpu.md."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh"), "--out", str(out)],
        cwd=root,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = json.loads(out.read_text())
    assert proc.returncode == 0 and summary["passed"] and not summary["dry_run"], proc.stdout[-4000:]
