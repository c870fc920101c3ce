"""Which worker group holds which role: checked once, before any worker starts."""

from __future__ import annotations

from collections.abc import Sequence

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
