"""Per-rank micro-batch sizes from verl's global micro-batch keys, derived, never written back.

verl's ``*.ppo_micro_batch_size`` / ``*.log_prob_micro_batch_size`` / ``critic.forward_micro_batch_size`` are
global: each role splits one over its data-parallel ranks (its pool's workers, ``trainer.placement`` or
nnodes x n_gpus_per_node, over its Ulysses group size). `per_rank_micro_batches` computes the per-rank
sizes from the config as written; `fusedrl.role_config.build_role_configs` puts them into the typed
configs' ``*_per_gpu`` fields, and `fusedrl.config.load_config` reports the problems (not an integer, not a
multiple of the ranks) before Ray starts. The composed config itself keeps what the user wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GlobalMicroBatch:
    """One verl global key: the `RoleConfigs` section holding it and the per-rank field it sets, the role
    whose pool's ranks split it, and the section whose ``ulysses_sequence_parallel_size`` divides that pool
    (fusedrl computes the old log-probs, ``rollout.log_prob_*``, with the actor, and the reference's
    sequence parallelism follows the actor's)."""

    section: str
    field: str
    per_rank: str
    role: str
    sp_section: str

    @property
    def key(self) -> str:
        return f"{yaml_prefix(self.section)}.{self.field}"

    @property
    def per_rank_key(self) -> str:
        return f"{yaml_prefix(self.section)}.{self.per_rank}"

    @property
    def sp_key(self) -> str:
        return f"{yaml_prefix(self.sp_section)}.ulysses_sequence_parallel_size"


GLOBAL_MICRO_BATCHES = (
    GlobalMicroBatch("actor", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "actor", "actor"),
    GlobalMicroBatch(
        "rollout", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "actor", "actor"
    ),
    GlobalMicroBatch("ref", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "ref", "actor"),
    GlobalMicroBatch("critic", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "critic", "critic"),
    GlobalMicroBatch(
        "critic", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu", "critic", "critic"
    ),
)


def yaml_prefix(section: str) -> str:
    """The YAML path of a `RoleConfigs` section (``actor`` -> ``actor_rollout_ref.actor``)."""
    return f"actor_rollout_ref.{section}" if section in ("model", "actor", "ref", "rollout") else section


def data_parallel_size(trainer: Any, role: str, sp: Any) -> int | None:
    """The data-parallel ranks of ``role``: its pool's workers (``trainer``: the section, a mapping) over its
    Ulysses group size ``sp``; None where the config cannot say (the config check reports why)."""
    from fusedrl.placement_config import read_placement

    try:
        world = read_placement(trainer, []).world_of(role)
        size = int(sp or 1)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return world // size if size >= 1 and world % size == 0 else None


def per_rank_micro_batches(
    section: Callable[[str], Any], trainer: Any
) -> tuple[dict[tuple[str, str], int], list[str]]:
    """``{(section, per-rank field): size}`` for each global key given, and the problems of those that
    cannot be split. ``section(name)`` gives a `RoleConfigs` section's mapping as written (``actor``,
    ``critic``, ...); ``trainer`` the ``trainer`` section (its placement)."""
    sizes: dict[tuple[str, str], int] = {}
    problems: list[str] = []
    for g in GLOBAL_MICRO_BATCHES:
        value = section(g.section).get(g.field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"`{g.key}`={value!r}: must be an integer >= 1 (or null).")
            continue
        ranks = data_parallel_size(
            trainer, g.role, section(g.sp_section).get("ulysses_sequence_parallel_size")
        )
        if ranks is None:
            continue  # the placement or the Ulysses size is wrong: reported by validate
        if value % ranks:
            problems.append(
                f"`{g.key}`={value}: a global micro-batch is split evenly over the {g.role}'s {ranks} "
                f"data-parallel ranks (its pool's workers / `{g.sp_key}`); use a multiple of {ranks}, or set "
                f"`{g.per_rank_key}` instead."
            )
            continue
        sizes[(g.section, g.per_rank)] = value // ranks
    return sizes, problems
