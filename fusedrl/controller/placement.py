"""Which worker group holds which role (checked once, before any worker starts), the run's device slots
(one `ResourcePool` per ``trainer.placement`` pool), and the started groups looked up by role.

Roles on one pool share one worker per slot (``role_groups`` may split them into several groups on the
same slots); roles on different pools run in different processes. The weight sync then takes the
broadcast route (`fusedrl.controller.weight_sync.BroadcastRoute`) instead of the in-place stream."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import ray
import torch

from fusedrl.auto_defaults import announce_resolved
from fusedrl.controller.weight_sync import BroadcastRoute
from fusedrl.controller.worker_group import ResourcePool, WorkerGroup, cpus_for_cpu_slots
from fusedrl.metrics import Metrics, mean_over_ranks
from fusedrl.placement_config import Placement, PoolSpec, read_placement
from fusedrl.role_config import RoleConfigs
from fusedrl.utils.hardware import slot_cpu_sets

# Roles that must share the actor's worker when they are on the actor's pool: the in-place weight stream
# goes from the actor's shards into the engine of the same process, and the run checkpoint saves actor and
# critic from the same workers. (A rollout on a pool of its own takes the broadcast route instead.)
WITH_ACTOR = ("rollout", "critic")


def check_role_groups(needed: Sequence[str], role_groups: Sequence[Sequence[str]] | None) -> list[list[str]]:
    """The role groups to start (default: one fused group of ``needed``); ValueError naming every problem:
    a needed role not placed, a role placed twice or not used by the run, a role apart from the actor that
    must share its worker."""
    groups = [list(needed)] if role_groups is None else [list(g) for g in role_groups]
    placed = [r for g in groups for r in g]
    problems = [f"role {r!r} is not placed" for r in needed if r not in placed]
    problems += [f"role {r!r} is placed twice" for r in set(placed) if placed.count(r) > 1]
    problems += [f"role {r!r} is not used by this run" for r in set(placed) - set(needed)]
    home = next((g for g in groups if "actor" in g), [])
    problems += [
        f"role {r!r} must share the actor's group"
        for r in WITH_ACTOR
        if "actor" in needed and r in placed and r not in home
    ]
    if problems:
        raise ValueError(f"role_groups={groups}: " + "; ".join(sorted(problems)))
    return groups


def plan_groups(
    placement: Placement, needed: Sequence[str], role_groups: Sequence[Sequence[str]] | None
) -> list[tuple[str, list[str]]]:
    """``(pool, roles)`` of each worker group to start: per pool, its roles as one fused group, or the
    ``role_groups`` that fall on it (each group on one pool; `check_role_groups` per pool). ValueError
    naming every problem."""
    pools = placement.used_pools(needed)
    problems: list[str] = []
    if role_groups is not None:
        for g in role_groups:
            on = sorted({placement.pool_of(r) for r in g})
            if len(on) > 1:
                problems.append(f"group {list(g)} spans the pools {on}; a worker group lives on one pool")
    plan: list[tuple[str, list[str]]] = []
    for pool in pools:
        here = [r for r in needed if placement.pool_of(r) == pool]
        mine = (
            None
            if role_groups is None
            else [list(g) for g in role_groups if g and placement.pool_of(g[0]) == pool]
        )
        try:
            plan += [(pool, g) for g in check_role_groups(here, mine)]
        except ValueError as err:
            problems.append(f"pool {pool!r}: {err}")
    if problems:
        raise ValueError("; ".join(problems))
    return plan


def cluster_has_gpus() -> bool:
    """Whether the workers get GPUs: the Ray cluster's resources once Ray runs (a head node without a GPU
    may drive GPU workers, the usual ``RAY_ADDRESS`` set-up), this machine's CUDA before."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0)) > 0
    return torch.cuda.is_available()


def resource_pool(spec: PoolSpec, cpus_per_slot: float | None = None) -> ResourcePool:
    """Ray's side of one pool: GPUs where the cluster has them, else CPU slots of ``cpus_per_slot`` CPUs."""
    use_gpu = cluster_has_gpus()
    cpus = 1.0 if use_gpu else float(cpus_per_slot or cpus_for_cpu_slots(spec.world_size))
    return ResourcePool(
        slots_per_node=spec.slots_per_node, nnodes=spec.nnodes, use_gpu=use_gpu, cpus_per_slot=cpus
    )


def slot_pool(trainer_cfg: Any) -> ResourcePool:
    """The run's device slots, ``trainer.nnodes x trainer.n_gpus_per_node``: GPUs where the cluster has them,
    else CPU slots that share the free cores (Ray gives each worker ``OMP_NUM_THREADS`` = its CPUs, so one
    worker on a 2-core box trains on 2 threads)."""
    return resource_pool(
        PoolSpec(nnodes=int(trainer_cfg.nnodes), slots_per_node=int(trainer_cfg.n_gpus_per_node))
    )


BIND_ENV = "FUSEDRL_BIND_CPUS"


def _alive_nodes() -> int:
    """The Ray nodes of the cluster that are alive."""
    return sum(1 for node in ray.nodes() if node["Alive"])


class RoleGroups:
    """The run's worker groups, looked up by the roles they hold (several roles may share one group)."""

    def __init__(self, by_role: dict[str, WorkerGroup] | None = None) -> None:
        self.by_role: dict[str, WorkerGroup] = dict(by_role or {})

    weight_route: BroadcastRoute | None = None
    _current_at: int | None = None  # the actor group's `calls` when an in-place sync left the engines current
    # What the workers' `auto` keys became (`fusedrl.auto_defaults`), by dotted key; empty before they start.
    auto_settings: dict[str, Any] = {}  # replaced by `start_placed`, never mutated

    @classmethod
    def start_placed(
        cls,
        worker_cls: type,
        worker_config: RoleConfigs,
        needed: Sequence[str],
        role_groups: Sequence[Sequence[str]] | None = None,
    ) -> RoleGroups:
        """Every group of `plan_groups` on its pool (``trainer.placement`` of the typed ``worker_config``, which
        every worker receives); when the rollout is on
        another pool than the actor, the broadcast weight-sync route is connected too. The CPU slots of all
        pools share the free cores evenly. Each pool's workers see its own ``nnodes`` / ``n_gpus_per_node``
        (their rendezvous host and local device index)."""
        placement = read_placement(dataclasses.asdict(worker_config.trainer))
        plan = plan_groups(placement, needed, role_groups)
        cpus = cpus_for_cpu_slots(placement.total_slots(needed))
        pools = {name: resource_pool(placement.pools[name], cpus) for name in placement.used_pools(needed)}
        by_role: dict[str, WorkerGroup] = {}
        started: set[str] = set()
        for pool_name, roles in plan:
            spec = placement.pools[pool_name]
            group = WorkerGroup.start(
                worker_cls,
                pools[pool_name],
                worker_config.with_slots(nnodes=spec.nnodes, n_gpus_per_node=spec.slots_per_node),
                init=lambda w, addr, port: w.init_roles.remote(addr, port),
                roles=roles,
                share_slots=pool_name in started,
            )
            started.add(pool_name)
            by_role.update(dict.fromkeys(roles, group))
        groups = cls(by_role)
        if len(groups.unique()) == 1:  # moves need no round trip of their own (`WorkerGroup.send_all`)
            groups.unique()[0].defer_moves = True
        groups.auto_settings = announce_resolved(groups.unique())  # one line printed, the values kept
        groups.bind_cpus(pools, cpus)
        if "rollout" in by_role and by_role["rollout"] is not by_role["actor"]:
            # Pools may land on different nodes: then the sync store listens on the node's address.
            multi_node = _alive_nodes() > 1
            bucket_mb = float(worker_config.trainer.placement.weight_sync_bucket_mb)
            groups.weight_route = BroadcastRoute(by_role["actor"], by_role["rollout"], bucket_mb, multi_node)
            groups.weight_route.connect()
        return groups

    def bind_cpus(self, pools: dict[str, ResourcePool], per_slot: int) -> None:
        """On one machine without GPUs, bind each slot's workers to cores of their own (`slot_cpu_sets`,
        ``per_slot`` cores each): the scheduler otherwise moves the workers' threads between cores, and each
        move costs the caches (2 cores: 4% of a bf16 GRPO step, benchmarks/results_archive/2026-12.md,
        2026-12-03). ``FUSEDRL_BIND_CPUS=0`` leaves them unbound; so does a cluster of several machines or a
        run with more slots than cores."""
        if os.environ.get(BIND_ENV, "1") == "0" or any(p.use_gpu for p in pools.values()):
            return
        if any(p.nnodes != 1 for p in pools.values()) or _alive_nodes() != 1:
            return
        sets = slot_cpu_sets([p.world_size for p in pools.values()], per_slot, os.sched_getaffinity(0))
        if sets is None:
            return
        by_pool = {id(pool): pool_sets for pool, pool_sets in zip(pools.values(), sets, strict=True)}
        for group in self.unique():
            group.run_shards(lambda w, cpus: w.bind_cpus.remote(cpus), by_pool[id(group.pool)])

    def sync_in_place(self, force: bool) -> Metrics | None:
        """`PPOTrainer.sync_weights` where the engines live in the actor's workers (no weight route): one call,
        `WorkerDict.sync_engine` (the workers decide, agree and stream); None where the rollout has a pool of
        its own. Right after such a sync, with no call to the workers since (`WorkerGroup.calls`: the engines'
        phase changes only by calls), the engines still hold the actor's weights: then no call at all."""
        if self.weight_route is not None or "rollout" not in self.by_role:
            return None
        group = self.group_for("actor")
        if not force and self._current_at == group.calls:
            return {"sync/streamed": 0.0}
        per_rank = group.run_all(lambda w: w.sync_engine.remote(force))
        self._current_at = group.calls
        return mean_over_ranks(per_rank)

    def engines_need_stream(self) -> tuple[bool, int | None]:
        """Whether the rollout engines need the actor's weights, as the rollout workers decide from their
        phase (`WorkerDict.rollout_needs_stream`); and, for a rollout pool, the actor's policy version. In
        place the worker saw its actor change (no version asked); a rollout pool is told the version and
        compares it with the one it holds. Every rank must agree (one collective stream or none)."""
        version = None
        if self.weight_route is not None:
            version = int(self.group_for("actor").run_rank0(lambda w: w.policy_version.remote()))
        needs = set(self.group_for("rollout").run_all(lambda w: w.rollout_needs_stream.remote(version)))
        if len(needs) != 1:
            raise RuntimeError(f"rollout ranks disagree whether their engines need a stream: {sorted(needs)}")
        return needs.pop(), version

    def stream_weights(self, version: int | None = None) -> list[dict[str, float]]:
        """The actor's weights (policy ``version``) into every rollout engine: in place where they share the
        workers (each rank's metrics), else over the broadcast route (one set of metrics). The actor's shards
        must be on the device and the engines' weights awake."""
        if self.weight_route is None:
            return self.group_for("actor").run_all(lambda w: w.update_weights.remote())
        return [self.weight_route.sync(version)]

    def group_for(self, role: str) -> WorkerGroup:
        """The worker group holding ``role``."""
        if role not in self.by_role:
            raise RuntimeError(f"no worker group holds {role!r} (call init_workers() first)")
        return self.by_role[role]

    def unique(self) -> list[WorkerGroup]:
        """Each worker group once, in start order."""
        return list({id(g): g for g in self.by_role.values()}.values())

    def tensor_crossings(self) -> int:
        """Tensors that crossed Ray between the driver and every group so far (`TensorTraffic.crossings`)."""
        return sum(group.traffic.crossings for group in self.unique())

    def shutdown(self) -> None:
        for group in self.unique():
            group.shutdown()
        self.by_role = {}
        self.weight_route = None
