"""``trainer.placement``: pools and role -> pool, read and checked before Ray starts (every problem named at
once), the worker groups each pool gets, and the bucket layout of the cross-pool weight sync."""

from __future__ import annotations

import pytest
import torch
from support import small_grpo_config

from fusedrl.config import ConfigError, compose_config
from fusedrl.controller.placement import plan_groups
from fusedrl.placement_config import GLOBAL_POOL, PoolSpec, read_placement
from fusedrl.workers.weight_sync import ALIGN, bucket_plan, bucket_size

GEN = "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}"


def _config(tiny_model_dir, arithmetic_data, *extra, validate=True):
    return small_grpo_config(tiny_model_dir, arithmetic_data, *extra, validate=validate)


def test_default_is_one_fused_pool(tiny_model_dir, arithmetic_data):
    cfg = _config(
        tiny_model_dir, arithmetic_data, "trainer.nnodes=2", "trainer.n_gpus_per_node=3", validate=False
    )
    placement = read_placement(cfg.source.trainer)
    assert placement.pools == {GLOBAL_POOL: PoolSpec(nnodes=2, slots_per_node=3)}
    assert placement.role_pool == {} and not placement.rollout_apart
    roles = ["actor", "rollout", "ref"]
    assert plan_groups(placement, roles, None) == [(GLOBAL_POOL, roles)]
    # role_groups on the one pool: as before the placement existed (groups share the pool's slots).
    assert plan_groups(placement, roles, [["actor", "rollout"], ["ref"]]) == [
        (GLOBAL_POOL, ["actor", "rollout"]),
        (GLOBAL_POOL, ["ref"]),
    ]


def test_separate_rollout_pool(tiny_model_dir, arithmetic_data):
    cfg = _config(tiny_model_dir, arithmetic_data, GEN, "trainer.placement.roles={rollout: gen}")
    placement = read_placement(cfg.source.trainer)
    assert placement.rollout_apart
    assert placement.world_of("actor") == placement.world_of("rollout") == 1
    assert placement.total_slots(["actor", "rollout"]) == 2
    assert plan_groups(placement, ["actor", "rollout"], None) == [
        (GLOBAL_POOL, ["actor"]),
        ("gen", ["rollout"]),
    ]
    with pytest.raises(ValueError, match=r"group \['actor', 'rollout'\] spans the pools"):
        plan_groups(placement, ["actor", "rollout"], [["actor", "rollout"]])


def test_every_problem_is_named_at_once(tiny_model_dir, arithmetic_data):
    with pytest.raises(ConfigError) as err:
        _config(
            tiny_model_dir,
            arithmetic_data,
            "trainer.placement.pools={gen: {nnodes: 0, n_gpus_per_node: 1}, rm: {gpus: 2}, "
            "global: {nnodes: 1, n_gpus_per_node: 1}, big: {nnodes: 1, n_gpus_per_node: 3}}",
            "trainer.placement.roles={rollout: gen, critic: big, reward: big, ref: nowhere, actor: big}",
            "trainer.placement.weight_sync_bucket_mb=0",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        )
    text = str(err.value)
    for needle in [
        "`trainer.placement.pools.gen`={'nnodes': 0, 'n_gpus_per_node': 1}: nnodes and n_gpus_per_node must be",
        "`trainer.placement.pools.rm`={'gpus': 2}: a pool is {nnodes: N, n_gpus_per_node: S}",
        "`trainer.placement.pools.global`: `global` is trainer.nnodes x trainer.n_gpus_per_node",
        "`trainer.placement.roles.reward`: unknown role",
        "`trainer.placement.roles.ref`='nowhere': no such pool",
        "`trainer.placement.roles.critic`: this run has no critic role",
        "`trainer.placement.weight_sync_bucket_mb`=0: must be a number > 0",
        # The actor's pool has 3 workers: 4 x 2 samples do not divide across them.
        "= 8 samples do not divide across 3 workers",
        # The rollout's pool is `global` again (gen was rejected): 1 worker, TP 2.
        "`actor_rollout_ref.rollout.tensor_model_parallel_size`=2: must divide the number of rollout workers (1",
    ]:
        assert needle in text, (needle, text)


def test_roles_that_must_stay_with_the_actor(tiny_model_dir, arithmetic_data):
    with pytest.raises(ConfigError) as err:
        _config(
            tiny_model_dir,
            arithmetic_data,
            GEN,
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.rollout.name=hf",
            "trainer.placement.roles={rollout: gen, critic: gen}",
        )
    text = str(err.value)
    assert "`trainer.placement.roles.critic`='gen': the critic must be on the actor's pool ('global')" in text
    assert (
        "`trainer.placement.roles.rollout`='gen': rollout.name=hf generates with the actor's own module"
        in text
    )


def test_rollout_pool_sized_for_tensor_parallelism(tiny_model_dir, arithmetic_data):
    ok = _config(
        tiny_model_dir,
        arithmetic_data,
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 2}}",
        "trainer.placement.roles={rollout: gen}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    )
    assert read_placement(ok.source.trainer).world_of("rollout") == 2
    with pytest.raises(ConfigError, match="must divide the number of rollout workers \\(3"):
        _config(
            tiny_model_dir,
            arithmetic_data,
            "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 3}}",
            "trainer.placement.roles={rollout: gen}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        )


def test_bucket_plan_cuts_the_manifest_alike_everywhere():
    manifest = [
        ("a", [3, 5], "torch.float32"),  # 60 B
        ("b", [7], "torch.bfloat16"),  # 14 B
        ("c", [100], "torch.float32"),  # 400 B: larger than a bucket, alone
        ("d", [2, 2], "torch.float32"),  # 16 B
    ]
    buckets = bucket_plan(manifest, bucket_bytes=128)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    a, b = buckets[0]
    assert (a.offset, a.nbytes) == (0, 60) and (b.offset, b.nbytes) == (64, 14)  # 60 rounded up to ALIGN
    assert all(e.offset % ALIGN == 0 for bucket in buckets for e in bucket)
    assert [bucket_size(x) for x in buckets] == [78, 400, 16]
    assert b.dtype == torch.bfloat16 and b.shape == (7,)
    # Packing and reading back through the plan's offsets gives every tensor bit for bit.
    tensors = {name: torch.randn(shape).to(getattr(torch, d.split(".")[1])) for name, shape, d in manifest}
    for bucket in buckets:
        buf = torch.empty(bucket_size(bucket), dtype=torch.uint8)
        for e in bucket:
            buf[e.offset : e.offset + e.nbytes].copy_(tensors[e.name].reshape(-1).view(torch.uint8))
        for e in bucket:
            got = buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            assert torch.equal(got, tensors[e.name]), e.name


def test_lora_keeps_rollout_and_ref_on_the_actors_pool(tiny_model_dir, arithmetic_data):
    # LoRA streams only the adapted modules in place, and its reference is the actor's own module.
    with pytest.raises(ConfigError) as err:
        _config(
            tiny_model_dir,
            arithmetic_data,
            GEN,
            "trainer.placement.roles={rollout: gen, ref: gen}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.actor.use_kl_loss=true",
        )
    for role in ("rollout", "ref"):
        assert (
            f"with LoRA (actor_rollout_ref.model.lora_rank > 0) the {role} must be on the actor's pool"
            in str(err.value)
        )


def test_ray_is_sized_for_every_pool_and_for_sft(tiny_model_dir, arithmetic_data):
    from fusedrl.trainer.runtime import run_slots

    assert run_slots(_config(tiny_model_dir, arithmetic_data, validate=False)) == 1
    two_pools = _config(tiny_model_dir, arithmetic_data, GEN, "trainer.placement.roles={rollout: gen}")
    assert run_slots(two_pools) == 2
    # The SFT config has no placement section (init_ray once failed on it with a ConfigKeyError).
    sft = compose_config(
        ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"], config_name="sft_trainer", validate_config=False
    )
    assert run_slots(sft) == 2


def test_cross_pool_manifest_travels_in_the_engines_dtype():
    """float32 master weights to a bf16 engine: the manifest (and so every bucket and the broadcast) carries
    floating tensors in bf16, half the bytes; integer buffers keep their dtype."""
    from types import SimpleNamespace

    from fusedrl.workers.weight_sync import WeightSyncEndpoint

    model = torch.nn.Linear(4, 8)
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    endpoint = WeightSyncEndpoint()
    endpoint.actor = SimpleNamespace(model=model)
    endpoint.rollout = SimpleNamespace(param_dtype=lambda: torch.bfloat16)
    wire = endpoint.rollout_param_dtype()
    assert wire == "torch.bfloat16"
    as_master = endpoint.weight_manifest()
    as_engine = endpoint.weight_manifest(wire)
    assert [d for _, _, d in as_master] == ["torch.float32", "torch.float32", "torch.int64"]
    assert [d for _, _, d in as_engine] == ["torch.bfloat16", "torch.bfloat16", "torch.int64"]

    def total(manifest):
        return sum(bucket_size(b) for b in bucket_plan(manifest, bucket_bytes=1 << 20))

    assert total(as_engine) < 0.6 * total(as_master)
