"""CPU-side checks of the CUDA path: device selection, engine dtype, allocator settings, host buffers.

What cannot run without a GPU (page-locking, mem_get_info, NCCL) is in tests/gpu and in
``scripts/gpu_check.sh``; here the rules and the packing they rely on are checked with fake environments
and real FSDP2 (gloo) on the CPU.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from support import spawned_result

from fusedrl.workers.device import local_device_index, visible_device_count
from fusedrl.workers.rollout.base import rollout_dtype


# ---------------------------------------------------------------------- 1. device selection
@pytest.mark.parametrize("rank", [0, 1, 5, 7])
def test_ray_gives_each_worker_one_device_which_is_index_0(rank):
    # Ray with num_gpus=1: CUDA_VISIBLE_DEVICES is this worker's one device; CUDA counts 1.
    env = {"CUDA_VISIBLE_DEVICES": str(rank % 8)}
    assert local_device_index(rank, 8, device_count=1, environ=env) == 0


def test_every_device_visible_uses_the_slot_on_the_node():
    # torchrun-style: 8 visible devices, 16 ranks over two nodes.
    assert [local_device_index(r, 8, device_count=8, environ={}) for r in (0, 3, 8, 15)] == [0, 3, 0, 7]
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert local_device_index(11, 8, device_count=8, environ=env) == 3


def test_fewer_visible_devices_than_slots_wrap_around():
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert visible_device_count(env, 2) == 2
    assert [local_device_index(r, 4, device_count=2, environ=env) for r in range(4)] == [0, 1, 0, 1]


def test_cpu_machine_keeps_the_slot_and_hidden_devices_are_an_error():
    assert local_device_index(5, 4, device_count=0, environ={}) == 1  # LOCAL_RANK on a CPU node
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=''"):
        local_device_index(0, 1, device_count=1, environ={"CUDA_VISIBLE_DEVICES": ""})


# ---------------------------------------------------------------------- 7. engine dtype
def test_engine_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert rollout_dtype("auto", cuda=True) == "bfloat16"
    assert rollout_dtype("auto", cuda=False) == "float32"
    assert rollout_dtype("float32", cuda=True) == "float32"  # an explicit choice is kept
    assert rollout_dtype("bfloat16", cuda=False) == "bfloat16"


def test_yaml_default_engine_dtype_is_verls_bfloat16():
    """The default is verl's (bfloat16: flash attention on CUDA needs fp16/bf16); ``auto`` is accepted and
    resolves to bfloat16 on CUDA, float32 on CPU. (CPUs without native bf16 switch to float32 at config
    time: tests/integration/test_cpu_dtypes.py.)"""
    import yaml

    path = Path(__file__).resolve().parents[2] / "trainer" / "config" / "ppo_trainer.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["actor_rollout_ref"]["rollout"]["dtype"] == "bfloat16"


# ---------------------------------------------------------------------- 4. allocator settings
def test_fusedrl_never_writes_allocator_settings():
    """fusedrl dropped its expandable-segments toggle (vLLM's pool does it); nothing may write the
    allocator's settings, which would reset the user's other options."""
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("fusedrl", "workers", "trainer", "third_party"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            if "_set_allocator_settings" in text or "_accelerator_setAllocatorSettings" in text:
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


def test_vllm_pool_switches_expandable_segments_itself_and_keeps_other_options():
    """What makes our toggle redundant, checked on the installed vLLM: its sleep-mode pool turns
    expandable segments off around its own allocations, rewriting only that field."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from vllm.device_allocator import alloc_conf

    conf = "expandable_segments:True,max_split_size_mb:512,garbage_collection_threshold:0.6"
    off = alloc_conf.with_conf_flag(conf, alloc_conf.EXPANDABLE_SEGMENTS, False)
    assert off == "expandable_segments:False,max_split_size_mb:512,garbage_collection_threshold:0.6"
    assert alloc_conf.conf_flag_enabled(conf, "expandable_segments")
    cumem = Path(importlib.util.find_spec("vllm.device_allocator").origin).parent / "cumem.py"
    source = cumem.read_text()
    body = source[source.index("    def use_memory_pool(") :]
    body = body[: body.index("\n    def ", 10)]
    assert "with_conf_flag(prev_conf, EXPANDABLE_SEGMENTS, False)" in body
    assert "set_alloc_conf(prev_conf)" in body  # the user's whole string is written back


# ---------------------------------------------------------------------- 5. host buffers
def test_host_buffer_slots_are_exact_and_aligned():
    from fusedrl.workers.host_buffer import ALIGN, HostBuffer

    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, dtype=torch.bfloat16)]
    buf = HostBuffer([*tensors, tensors[0]], pin=False)  # a repeated tensor gets one slot
    payload = sum(t.numel() * t.element_size() for t in tensors)
    assert payload <= buf.nbytes <= payload + (len(tensors) + 1) * ALIGN
    copies = [buf.copy_in(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.data_ptr() % ALIGN == 0
        assert c.untyped_storage().data_ptr() == buf.storage.untyped_storage().data_ptr()
    assert torch.randn(1) not in buf


def test_host_buffer_does_not_keep_the_offloaded_tensors_alive():
    """The device tensor an offload replaces must be freed at once (a strong reference in the buffer kept
    every AdamW moment on an H200's memory through the rollout)."""
    import gc
    import weakref

    from fusedrl.workers.host_buffer import HostBuffer
    from fusedrl.workers.memory import move_optimizer_state

    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w], lr=1e-3)
    w.grad = torch.randn(4, 3)
    opt.step()
    moment = opt.state[w]["exp_avg"]
    expected, ref = moment.clone(), weakref.ref(moment)
    buf = HostBuffer([moment], pin=False)
    del moment
    move_optimizer_state(opt, "cpu", buf)  # the offload's move: the moment is replaced by its host copy
    gc.collect()
    assert ref() is None, "the buffer (or the move) still holds the replaced tensor"
    assert torch.equal(opt.state[w]["exp_avg"], expected)
    assert opt.state[w]["exp_avg"].untyped_storage().data_ptr() == buf.storage.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="no slot"):
        buf.copy_in(opt.state[w]["exp_avg"])


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_step_counter_moves_with_the_state_when_fused(fused):
    """torch's fused (and capturable) AdamW keeps ``step`` on the parameters' device and refuses a host one:
    an offload + reload must take it along. The plain AdamW keeps it on the host: it stays. (Moved to
    ``meta`` here, a device a CPU test can reach.)"""
    from fusedrl.workers.memory import move_optimizer_state

    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w], lr=1e-3, fused=fused or None)
    w.grad = torch.randn(4, 3)
    opt.step()
    move_optimizer_state(opt, "meta")
    state = opt.state[w]
    assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
    assert state["step"].device.type == ("meta" if fused else "cpu")


def _offload_into_host_buffers(port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.workers.fsdp import apply_fsdp2, build_mesh, load_causal_lm
    from fusedrl.workers.memory import Offloader, optimizer_state_tensors

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = apply_fsdp2(load_causal_lm(model_dir, "float32"), build_mesh())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, model.config.vocab_size, (2, 16))  # [B, T]

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()

        step()
        params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        moments = [t.to_local().clone() for t in optimizer_state_tensors(optimizer) if t.dim() > 0]
        mem = Offloader("actor", model, optimizer, param_offload=True, optimizer_offload=True, events=[])
        mem.use_host_buffers = True  # the CUDA path's packing, without page-locking
        mem.offload_all()
        bases = {mem._param_host.storage.data_ptr(), mem._optim_host.storage.data_ptr()}
        in_buffers = all(p.to_local().untyped_storage().data_ptr() in bases for p in model.parameters())
        moments_in = all(
            t.to_local().untyped_storage().data_ptr() in bases
            for t in optimizer_state_tensors(optimizer)
            if t.dim() > 0
        )
        ratio = mem.host_bytes() / mem.offloaded_bytes
        same = all(torch.equal(params[n], p.to_local()) for n, p in model.named_parameters())
        same_moments = all(
            torch.equal(a, b.to_local())
            for a, b in zip(moments, [t for t in optimizer_state_tensors(optimizer) if t.dim() > 0])
        )
        mem.load_all()
        step()  # FSDP2 trains on from the re-wrapped shards
        changed = all(not torch.equal(params[n], p.to_local()) for n, p in model.named_parameters())
        torch.save(
            {
                "in_buffers": in_buffers,
                "moments_in": moments_in,
                "ratio": ratio,
                "same": same,
                "same_moments": same_moments,
                "changed": changed,
                "metrics": mem.host_metrics(),
                "events": mem.events,
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def test_offload_packs_fsdp2_shards_and_adamw_state_into_exact_host_buffers(tiny_model_dir, tmp_path):
    r = spawned_result(_offload_into_host_buffers, tiny_model_dir, tmp_path, 300)
    assert r["in_buffers"] and r["moments_in"], "offloaded state must live in the role's host buffers"
    assert r["same"] and r["same_moments"], "the host copy must be bit-identical"
    # 256-byte alignment over a few dozen tensors of a 0.4M-parameter model: well under 1%.
    assert 1.0 <= r["ratio"] <= 1.01, r["ratio"]
    assert r["metrics"]["memory/actor_host_bytes_per_offloaded_byte"] == pytest.approx(r["ratio"])
    assert r["changed"], "training must go on from the reloaded shards"
    assert r["events"] == [
        "actor.offload_optimizer",
        "actor.offload_params",
        "actor.load_params",
        "actor.load_optimizer",
    ]


def test_memory_metrics_are_importable_and_cpu_safe():
    from fusedrl.workers.memory import allocator_settings, device_free_total, memory_metrics

    m = memory_metrics("x")
    assert m["memory/cpu_rss_gb_after_x"] > 0
    if not torch.cuda.is_available():
        assert device_free_total() is None and allocator_settings() == ""
        assert not any("device_free" in k for k in m)
