"""bf16 on CPU: mixed precision trains where it is used, and float32 replaces it where the CPU has no bf16.

* bf16 mixed precision (FSDP2 ``param_dtype=bfloat16``, vLLM in bf16) trains: the workers really compute
  in bf16, the loss is finite, every actor parameter changes, and the rollout check passes its bf16 bound.
  ``trainer.emulated_bf16=allow`` keeps bf16 on CPUs without native bf16 too, so this runs everywhere.
* Where the CPU has no native bf16 (the detection faked here), the same command line runs in float32: one
  line says which keys were switched and why, and the workers really compute in float32.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from support import started_trainer, varied_score

from fusedrl.trainer.health_checks import rollout_check_bound

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

BF16_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.param_dtype",
    "actor_rollout_ref.ref.fsdp_config.param_dtype",
    "actor_rollout_ref.rollout.dtype",
)


def _overrides(model_dir: str, train: str, out: str) -> list[str]:
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
        "trainer.rollout_check_tol=auto",
        f"trainer.default_local_dir={out}",
        *(f"{key}=bfloat16" for key in BF16_KEYS),
    ]


def test_bf16_mixed_precision_trains(tiny_model_dir, arithmetic_data, tmp_path):
    from fusedrl.config import ConfigError, load_config
    from fusedrl.utils.hardware import capped_amx_bf16

    overrides = [
        *_overrides(tiny_model_dir, arithmetic_data[0], str(tmp_path)),
        "trainer.emulated_bf16=allow",
    ]
    rollout = "bfloat16"
    if capped_amx_bf16() is not None:  # `make test-avx2` on an AMX CPU: vLLM's AMX bf16 kernels would abort
        with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.dtype.*float32"):
            load_config(overrides)
        overrides.append("actor_rollout_ref.rollout.dtype=float32")  # training stays bf16
        rollout = "float32"
    with started_trainer(overrides) as trainer:
        assert rollout_check_bound(trainer.run) == 0.1  # the bf16 bound of `auto`
        (dtypes,) = trainer.workers.run_all(lambda w: w.compute_dtypes.remote())
        assert dtypes == {"actor": "bfloat16", "rollout": rollout}
        if "OMP_NUM_THREADS" not in os.environ:  # one worker trains on every core Ray has (not Ray's 1)
            import ray

            (threads,) = trainer.workers.run_all(lambda w: w.torch_threads.remote())
            assert threads == int(ray.cluster_resources()["CPU"]), threads
        (before,) = trainer.workers.run_all(lambda w: w.actor_state.remote())
        metrics = trainer.fit()  # check_health runs the rollout check at the bf16 bound
        (after,) = trainer.workers.run_all(lambda w: w.actor_state.remote())
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert math.isfinite(metrics[key]), key
    assert metrics["actor/grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in after.values())  # float32 master weights
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert unchanged == [], unchanged
    gap = metrics["rollout/log_prob_abs_diff_mean"]
    assert 0 < gap <= 0.1, gap  # bf16 rounding shows (> 0) but stays within the bound
    print(f"bf16 rollout-vs-actor mean |log-prob gap| = {gap:.2e}")


def test_no_native_bf16_runs_float32_with_one_line(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, capsys
):
    from omegaconf import OmegaConf

    from fusedrl.config import ConfigError, load_config
    from fusedrl.trainer import runtime
    from fusedrl.utils import hardware

    monkeypatch.setattr(hardware, "native_bf16", lambda: (False, "CPU Fake AVX2-only (no avx512_bf16)"))
    monkeypatch.setattr(hardware, "capped_amx_bf16", lambda: None)  # an AVX2-only CPU has no AMX either
    overrides = _overrides(tiny_model_dir, arithmetic_data[0], str(tmp_path))

    with pytest.raises(ConfigError) as err:  # =error refuses, naming every key and the ways out
        load_config([*overrides, "trainer.emulated_bf16=error"])
    for key in BF16_KEYS:
        assert key in str(err.value)
    assert "trainer.emulated_bf16=switch" in str(err.value)

    allowed = load_config([*overrides, "trainer.emulated_bf16=allow"])
    assert str(allowed.actor_rollout_ref.rollout.dtype) == "bfloat16"
    capsys.readouterr()

    cfg = load_config(overrides)  # the default, switch
    lines = [line for line in capsys.readouterr().err.splitlines() if "native bf16" in line]
    assert len(lines) == 1, lines
    assert "Fake AVX2-only" in lines[0] and "float32" in lines[0]
    for key in BF16_KEYS:
        assert f"`{key}`" in lines[0]
        assert str(OmegaConf.select(cfg.source, key)) == "float32"

    with runtime.started_trainer(cfg, compute_score=varied_score) as trainer:
        assert rollout_check_bound(trainer.run) == 1e-3  # float32 on both sides: the tight bound
        (dtypes,) = trainer.workers.run_all(lambda w: w.compute_dtypes.remote())
        assert dtypes == {"actor": "float32", "rollout": "float32"}
        metrics = trainer.fit()
    assert metrics["rollout/log_prob_abs_diff_mean"] <= 1e-3
