"""Role placement as configured (``trainer.placement``), read and checked before Ray starts.

A *pool* is ``nnodes x n_gpus_per_node`` device slots. The pool ``global`` is always
``trainer.nnodes x trainer.n_gpus_per_node``; ``trainer.placement.pools`` adds named pools and
``trainer.placement.roles`` moves roles onto them (a role not named stays on ``global``). Roles on the same
pool share one worker per slot (the fused worker); roles on different pools run in different processes, so
the weight sync between the actor and the rollout then goes over a collective group made for it
(`fusedrl.controller.weight_sync`). The default (no pools, no roles) is one fused pool: today's run.

Pure config logic (no torch, no Ray), so `fusedrl.config_checks.validate` can call it. docs/placement.md has the
user's view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GLOBAL_POOL = "global"
PLACEABLE_ROLES = ("actor", "rollout", "ref", "critic", "reward_model")
# The run checkpoint saves the actor and the critic from the same workers.
WITH_ACTOR_ALWAYS = ("critic",)


@dataclass(frozen=True)
class PoolSpec:
    """``nnodes x slots_per_node`` device slots (GPUs, or CPU slots on a machine without GPUs)."""

    nnodes: int
    slots_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.slots_per_node


@dataclass(frozen=True)
class Placement:
    """The run's pools (in start order: ``global`` first) and the pool of each role."""

    pools: dict[str, PoolSpec]
    role_pool: dict[str, str]

    def pool_of(self, role: str) -> str:
        return self.role_pool.get(role, GLOBAL_POOL)

    def world_of(self, role: str) -> int:
        """Workers (ranks) of the pool holding ``role``."""
        return self.pools[self.pool_of(role)].world_size

    def used_pools(self, roles: Sequence[str]) -> list[str]:
        """The pools holding at least one of ``roles``, in `pools` order."""
        used = {self.pool_of(r) for r in roles}
        return [name for name in self.pools if name in used]

    def total_slots(self, roles: Sequence[str]) -> int:
        return sum(self.pools[p].world_size for p in self.used_pools(roles))

    @property
    def rollout_apart(self) -> bool:
        """Whether the rollout runs in other processes than the actor (the broadcast sync route)."""
        return self.pool_of("rollout") != self.pool_of("actor")


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value) if int(value) == value else None
    except (TypeError, ValueError):
        return None


def read_placement(trainer_cfg: Any, problems: list[str] | None = None) -> Placement:
    """The `Placement` of ``trainer`` (a config section or plain dict); each problem of the pools and
    roles appended to ``problems`` (when given; otherwise ValueError naming all of them)."""
    own: list[str] = [] if problems is None else problems
    start = len(own)
    pools: dict[str, PoolSpec] = {}
    slots = _int_or_none(trainer_cfg["n_gpus_per_node"])
    nnodes = _int_or_none(trainer_cfg["nnodes"])
    pools[GLOBAL_POOL] = PoolSpec(nnodes=max(1, nnodes or 1), slots_per_node=max(1, slots or 1))
    placement_cfg = trainer_cfg["placement"]
    for name, spec in dict(placement_cfg["pools"] or {}).items():
        key = f"trainer.placement.pools.{name}"
        if name == GLOBAL_POOL:
            own.append(
                f"`{key}`: `{GLOBAL_POOL}` is trainer.nnodes x trainer.n_gpus_per_node; give the pool another name."
            )
            continue
        if not isinstance(spec, Mapping) or set(spec) != {"nnodes", "n_gpus_per_node"}:
            own.append(
                f"`{key}`={spec!r}: a pool is {{nnodes: N, n_gpus_per_node: S}} (both keys, nothing else)."
            )
            continue
        n, s = _int_or_none(spec["nnodes"]), _int_or_none(spec["n_gpus_per_node"])
        if n is None or s is None or n < 1 or s < 1:
            own.append(f"`{key}`={dict(spec)}: nnodes and n_gpus_per_node must be integers >= 1.")
            continue
        pools[str(name)] = PoolSpec(nnodes=n, slots_per_node=s)
    role_pool: dict[str, str] = {}
    for role, pool in dict(placement_cfg["roles"] or {}).items():
        key = f"trainer.placement.roles.{role}"
        if role not in PLACEABLE_ROLES:
            own.append(f"`{key}`: unknown role; roles are {', '.join(PLACEABLE_ROLES)}.")
        elif str(pool) not in pools:
            own.append(
                f"`{key}`={pool!r}: no such pool; define it under trainer.placement.pools "
                f"(pools: {', '.join(pools)})."
            )
        else:
            role_pool[str(role)] = str(pool)
    bucket = trainer_cfg["placement"]["weight_sync_bucket_mb"]
    if not isinstance(bucket, (int, float)) or isinstance(bucket, bool) or bucket <= 0:
        own.append(f"`trainer.placement.weight_sync_bucket_mb`={bucket!r}: must be a number > 0.")
    if problems is None and len(own) > start:
        raise ValueError("; ".join(own[start:]))
    return Placement(pools=pools, role_pool=role_pool)


def placement_of(trainer: Any, problems: list[str] | None = None) -> Placement:
    """The `Placement` of the typed ``trainer`` section (`fusedrl.run_sections.TrainerConfig`): what the
    config checks read. `read_placement` stays a reader of the section as a mapping, the form its other
    callers hold (`fusedrl.micro_batches` reads the composed config's plain dict)."""
    return read_placement(dataclasses.asdict(trainer), problems)


def placement_problems(run: Any, roles: Sequence[str], problems: list[str]) -> Placement:
    """Check ``trainer.placement`` against the run (``run``: the typed sections; ``roles``: the roles it
    needs) and append every problem: roles moved that the run does not use, roles that must share the
    actor's pool, pool sizes that do not fit the batch sizes and the rollout's tensor parallelism. Returns
    the placement read."""
    placement = placement_of(run.trainer, problems)
    for role in placement.role_pool:
        if role not in roles:
            problems.append(
                f"`trainer.placement.roles.{role}`: this run has no {role} role (roles: {', '.join(roles)}); "
                "remove the entry."
            )
    actor_pool = placement.pool_of("actor")
    for role in WITH_ACTOR_ALWAYS:
        if role in roles and placement.pool_of(role) != actor_pool:
            problems.append(
                f"`trainer.placement.roles.{role}`={placement.pool_of(role)!r}: the {role} must be on the "
                f"actor's pool ({actor_pool!r}); the run checkpoint saves both from the same workers."
            )
    rollout = run.rollout
    if placement.rollout_apart:
        from fusedrl.workers.rollout.registry import engine_names, engine_traits

        if rollout.name in engine_names() and engine_traits(rollout.name).shares_actor_module:
            problems.append(
                f"`trainer.placement.roles.rollout`={placement.pool_of('rollout')!r}: rollout.name="
                f"{rollout.name} generates with the actor's own module; put it on the actor's pool "
                f"({actor_pool!r}) or use rollout.name=vllm."
            )
    if int(run.model.lora_rank) > 0:
        # LoRA streams only the adapted modules, in place, and its reference is the actor's own module.
        for role in ("rollout", "ref"):
            if role in roles and placement.pool_of(role) != actor_pool:
                problems.append(
                    f"`trainer.placement.roles.{role}`={placement.pool_of(role)!r}: with LoRA "
                    f"(actor_rollout_ref.model.lora_rank > 0) the {role} must be on the actor's pool "
                    f"({actor_pool!r}) for now."
                )
    # Batch sizes and TP against the pools: `fusedrl.config_cross_checks`, with the worlds below.
    return placement


def actor_world(run: Any) -> int | None:
    """Ranks of the actor's pool (``run``: the typed sections), as far as the placement is valid (its
    problems are reported by `placement_problems`); None when the trainer section cannot be read at all."""
    try:
        return placement_of(run.trainer, []).world_of("actor")
    except (KeyError, TypeError, AttributeError):
        return None


def rollout_world(run: Any) -> int | None:
    """Ranks of the rollout's pool, as far as the placement is valid (see `actor_world`)."""
    try:
        return placement_of(run.trainer, []).world_of("rollout")
    except (KeyError, TypeError, AttributeError):
        return None
