"""`trainer/runtime.py` reads the typed run (`RunConfig`; SFT: `SFTRoleConfigs`): what `init_ray` passes to
``ray.init`` (sizes, the engine's worker environment, ``trainer.ray_init``), with ``ray.init`` replaced."""

from __future__ import annotations

import os

import ray
from support import small_grpo_config


def _captured_init(monkeypatch) -> dict:
    seen: dict = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return seen


def test_init_ray_reads_the_typed_run(monkeypatch, tiny_model_dir, arithmetic_data):
    from fusedrl.run_config import RunConfig
    from fusedrl.trainer.runtime import init_ray
    from fusedrl.workers.rollout.registry import engine_traits

    cfg = small_grpo_config(
        tiny_model_dir,
        arithmetic_data,
        "trainer.ray_num_cpus=3",
        "trainer.ray_object_store_gb=0.5",
        "+trainer.ray_init.num_gpus=0",
    )
    assert isinstance(cfg, RunConfig)
    for given in (cfg, cfg.source):  # the typed run, or the DictConfig behind it (typed first)
        seen = _captured_init(monkeypatch)
        init_ray(given)
        assert seen["num_cpus"] == 3 and seen["object_store_memory"] == 1 << 29 and seen["num_gpus"] == 0
        env = seen["runtime_env"]["env_vars"]
        assert (
            dict(engine_traits("vllm").worker_env).items() <= env.items()
        )  # VLLM_ENABLE_V1_MULTIPROCESSING=0
        assert env["TOKENIZERS_PARALLELISM"] == "false"


def test_init_ray_for_sft_has_no_engine_env(monkeypatch):
    from fusedrl.config import compose_config
    from fusedrl.trainer.runtime import init_ray

    sft = compose_config(
        ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"], config_name="sft_trainer", validate_config=False
    )
    seen = _captured_init(monkeypatch)
    init_ray(sft)
    assert seen["num_cpus"] == max(os.cpu_count() or 1, 2)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in seen["runtime_env"]["env_vars"]
