"""Multi-node on Ray: ``trainer.nnodes=2 x n_gpus_per_node=1`` on two Ray nodes started in-process
(`ray.cluster_utils.Cluster`, one CPU each) trains GRPO exactly as ``nnodes=1 x n_gpus_per_node=2`` on one.

Both runs have two ranks with the same seeds, one CPU (one thread) each and the same gloo world; only where
Ray puts the workers differs: one bundle per node, STRICT_SPREAD, rank r on node r // n_gpus_per_node. So
the per-step metrics must agree to float32 reduction noise (they are in fact identical on one machine; the
tolerance leaves room for a different summation order, nothing more).
"""

from __future__ import annotations

import pytest
from support import FLOAT32_TRAINING, started_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

vllm = pytest.importorskip("vllm")

SKIP = ("timing_s/", "memory/", "perf/", "sync/peak_live", "worker/")


def _overrides(model_dir: str, train: str, run_dir: str, nnodes: int, slots: int) -> list[str]:
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        f"trainer.nnodes={nnodes}",
        f"trainer.n_gpus_per_node={slots}",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        "trainer.rollout_check_tol=1e-3",
        f"trainer.default_local_dir={run_dir}",
    ]


def _node_of(worker) -> str:
    import ray

    # Runs inside the worker: the Ray node it was scheduled on.
    return ray.get(worker.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _run(overrides: list[str]) -> tuple[list[dict[str, float]], list[str]]:
    with started_trainer(overrides) as trainer:
        metrics = [trainer.train_step() for trainer.global_step in (1, 2)]
        nodes = [_node_of(w) for w in trainer.workers.workers]
    return metrics, nodes


def test_two_ray_nodes_train_as_one(tiny_model_dir, arithmetic_data, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    train = arithmetic_data[0]
    store = 256 << 20
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=store, logging_level="WARNING")
    try:
        one, one_nodes = _run(_overrides(tiny_model_dir, train, str(tmp_path / "one"), 1, 2))
    finally:
        ray.shutdown()

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": store, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, logging_level="WARNING")
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        two, two_nodes = _run(_overrides(tiny_model_dir, train, str(tmp_path / "two"), 2, 1))
    finally:
        ray.shutdown()
        cluster.shutdown()

    assert len(set(one_nodes)) == 1
    # One worker per node (rank r in the bundle of node r // n_gpus_per_node).
    assert len(set(two_nodes)) == 2
    for step, (a, b) in enumerate(zip(one, two), start=1):
        keys = [k for k in a if not k.startswith(SKIP)]
        assert set(keys) <= set(b)
        assert a["actor/grad_norm"] > 0
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (step, k, a[k], b[k])
