"""Which worker group holds which role (checked once, before any worker starts), the run's device slots,
and the started groups looked up by role."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fusedrl.controller.worker_group import ResourcePool, WorkerGroup, cpus_for_cpu_slots

# Roles that must share the actor's worker: the in-place weight stream goes from the actor's shards into
# the engine of the same process, and the run checkpoint saves actor and critic from the same workers.
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
        f"role {r!r} must share the actor's group" for r in WITH_ACTOR if r in placed and r not in home
    ]
    if problems:
        raise ValueError(f"role_groups={groups}: " + "; ".join(sorted(problems)))
    return groups


def slot_pool(trainer_cfg: Any) -> ResourcePool:
    """The run's device slots, ``trainer.nnodes x trainer.n_gpus_per_node``: GPUs where CUDA is available,
    else CPU slots that share the free cores (Ray gives each worker ``OMP_NUM_THREADS`` = its CPUs, so one
    worker on a 2-core box trains on 2 threads)."""
    slots, nnodes = int(trainer_cfg.n_gpus_per_node), int(trainer_cfg.nnodes)
    use_gpu = torch.cuda.is_available()
    cpus = 1.0 if use_gpu else float(cpus_for_cpu_slots(slots * nnodes))
    return ResourcePool(slots_per_node=slots, nnodes=nnodes, use_gpu=use_gpu, cpus_per_slot=cpus)


class RoleGroups:
    """The run's worker groups, looked up by the roles they hold (several roles may share one group)."""

    def __init__(self, by_role: dict[str, WorkerGroup] | None = None) -> None:
        self.by_role: dict[str, WorkerGroup] = dict(by_role or {})

    @classmethod
    def start(
        cls, worker_cls: type, pool: ResourcePool, worker_config: dict[str, Any], groups: list[list[str]]
    ) -> RoleGroups:
        """One `WorkerGroup` per entry of ``groups`` (from `check_role_groups`), each building its roles
        (``init_roles``, collective per group). Groups after the first share the first one's slots."""
        by_role: dict[str, WorkerGroup] = {}
        for i, roles in enumerate(groups):
            group = WorkerGroup.start(
                worker_cls,
                pool,
                worker_config,
                init=lambda w, addr, port: w.init_roles.remote(addr, port),
                roles=roles,
                share_slots=i > 0,
            )
            by_role.update(dict.fromkeys(roles, group))
        return cls(by_role)

    def group_for(self, role: str) -> WorkerGroup:
        """The worker group holding ``role``."""
        if role not in self.by_role:
            raise RuntimeError(f"no worker group holds {role!r} (call init_workers() first)")
        return self.by_role[role]

    def unique(self) -> list[WorkerGroup]:
        """Each worker group once, in start order."""
        return list({id(g): g for g in self.by_role.values()}.values())

    def shutdown(self) -> None:
        for group in self.unique():
            group.shutdown()
        self.by_role = {}
