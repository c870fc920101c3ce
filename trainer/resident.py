"""The driver's side of data that stays where it was made (`fusedrl.resident`, issue 39 item 3).

`ResidentRows` numbers the training generations, remembers which worker group (and tensor-parallel size) made
each and which fields its workers keep, stamps the generated batch's ``resident_rows``, and sends a call's
shards as `ResidentShard` s (only the fields the workers do not hold are sent; rows a rank needs from
another engine are first exported by that engine's first rank, `WorkerDict.resident_export`, and fetched by
reference, once per rank and row) or, for a batch it cannot place, as the rows themselves
(`WorkerGroup.run_split`, the transfer path). A field kept on the workers (the reference's log-probs) is
held by the rank that computed it: a later call that splits the rows otherwise is refused, by name.

What stays: the request's ``prompts`` / ``prompt_mask`` and the rollout's answer (responses, masks, log-probs
and the rest of `PPOTrainer.response_fields`), which the driver also holds and never rewrites (a subclass
that rewrites one of them must set ``batch.resident_rows = None``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusedrl.batch import RolloutBatch, padded_rows
from fusedrl.controller import WorkerGroup
from fusedrl.resident import ResidentShard


@dataclass
class Generation:
    """One kept generation: the group and tensor-parallel size that made it, its step, the fields kept."""

    group: Any
    tp: int
    step: int
    fields: set[str] = field(default_factory=set)
    delivered: set[tuple[int, int, int]] = field(default_factory=set)  # (rank, engine, row) fetched there


class ResidentRows:
    """Generation ids, where their rows live, and the choice between resident and transfer calls."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: every call takes the transfer path (tests compare the two)
        self.count = 0
        self.generations: dict[int, Generation] = {}

    def request(
        self, group: Any, tp: int, step: int, validate: bool, fields: Sequence[str]
    ) -> tuple[int, int] | None:
        """The ``keep`` argument of one generation call: (generation id, step); None for validation."""
        if validate or not self.enabled:
            return None
        self.count += 1
        self.generations = {g: v for g, v in self.generations.items() if v.step >= step}  # as the workers do
        self.generations[self.count] = Generation(group, tp, step, {"prompts", "prompt_mask", *fields})
        return self.count, step

    @staticmethod
    def mark(batch: RolloutBatch, keep: tuple[int, int] | None, engines: int) -> RolloutBatch:
        """Stamp ``resident_rows`` on a generated batch split over ``engines`` shards (`split_for_ranks`)."""
        if keep is None:
            return batch
        b = batch.num_samples
        chunk = padded_rows(b, engines).numel() // engines
        i = torch.arange(b)
        batch.resident_rows = torch.stack(
            [torch.full_like(i, keep[0]), i // chunk, i % chunk], dim=1
        )  # [B, 3]
        return batch

    def shards(
        self, group: Any, batch: RolloutBatch, names: Sequence[str], replicas: int, keep: str | None = None
    ) -> tuple[list[ResidentShard], dict[int, dict[int, list[tuple[int, int, int]]]]] | None:
        """Each rank's `ResidentShard` of ``batch``'s fields ``names`` split as `WorkerGroup.run_split` splits
        (rank r: shard r // replicas), and the exports they need: ``{source rank: {rank: rows}}``; None
        where the batch's rows cannot be placed (no stamp, another group, a generation dropped)."""
        rows = batch.resident_rows
        if rows is None or not self.enabled:
            return None
        made = {g: self.generations.get(g) for g in set(rows[:, 0].tolist())}
        if any(m is None or m.group is not group for m in made.values()):
            return None
        local = tuple(n for n in names if all(n in m.fields for m in made.values() if m is not None))
        sent = [n for n in names if n not in local]
        if any(not isinstance(getattr(batch, n), torch.Tensor) for n in sent):
            return None
        b, n_shards = batch.num_samples, group.world_size // replicas
        index = padded_rows(b, n_shards)  # split_for_ranks' rows
        chunk = index.numel() // n_shards
        tp = torch.tensor([made[int(g)].tp for g in rows[:, 0].tolist()])  # type: ignore[union-attr]
        out: list[ResidentShard] = []
        exports: dict[int, dict[int, list[tuple[int, int, int]]]] = {}
        for rank in range(group.world_size):
            idx = index[(rank // replicas) * chunk : (rank // replicas + 1) * chunk]
            keys = [(int(g), int(e), int(r)) for g, e, r in rows[idx].tolist()]
            for (g, e, r), held in zip(keys, (rows[idx, 1] == rank // tp[idx]).tolist()):
                gen = made[g]
                assert gen is not None
                if e * gen.tp >= group.world_size:
                    return None  # not an engine of this group
                if not held and (rank, e, r) not in gen.delivered:  # made elsewhere (balancing, padding)
                    exports.setdefault(e * gen.tp, {}).setdefault(rank, []).append((g, e, r))
                    gen.delivered.add((rank, e, r))
            out.append(ResidentShard(keys, local, {n: getattr(batch, n)[idx] for n in sent}, keep))
        return out, exports

    def run_split(
        self,
        group: WorkerGroup,
        call: Callable[[Any, Any], Any],
        batch: RolloutBatch,
        names: Sequence[str],
        replicas: int,
        keep: str | None = None,
    ) -> list[Any]:
        """`WorkerGroup.run_split` of ``batch``'s fields ``names``, resident where `shards` allows (then a
        ``keep`` answer stays on the workers and comes back as None)."""
        placed = self.shards(group, batch, names, replicas, keep)
        if placed is None:
            missing = [n for n in names if getattr(batch, n) is None]
            if missing:
                raise RuntimeError(
                    f"fields {missing} stayed on the workers that computed them, but this call's rows moved "
                    "to other ranks since (fusedrl.resident): keep the batch's row order between those calls"
                )
            return group.run_split(call, batch.select_fields(*names), replicas=replicas)
        shards, exports = placed
        if (
            exports
        ):  # worker to worker: each source puts the rows, the ranks that need them fetch by reference
            wanted = [exports.get(rank, {}) for rank in range(group.world_size)]
            for per_rank in group.run_shards(lambda w, rows: w.resident_export.remote(rows), wanted):
                for rank, ref in per_rank.items():
                    shards[rank].fetch.append(ref)
        results = group.run_shards(call, shards)[::replicas]
        if keep is not None:
            for g in set(batch.resident_rows[:, 0].tolist()):
                self.generations[int(g)].fields.add(keep)
        return results
