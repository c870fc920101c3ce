"""The driver's side of data that stays where it was made (`fusedrl.resident`, issue 39 item 3).

`ResidentRows` numbers the training generations, remembers which worker group (and tensor-parallel size) made
each and which fields its workers keep, stamps the generated batch's ``resident_rows``, and sends a call's
shards as `ResidentShard` s (only the fields the workers do not hold are sent; rows a rank needs from
another engine are first exported by that engine's first rank, `WorkerDict.resident_export`, and fetched by
reference, once per rank and row; the export is sent, not awaited, just before the call that reads it) or, for a batch it cannot place, as the rows themselves
(`WorkerGroup.run_split`, the transfer path). A field kept on the workers (the reference's log-probs) is
held by the rank that computed it: a later call that splits the rows otherwise is refused, by name.
Fields may stay on the workers only (``stay``, set by `staying` around a training step's generation: the
rollout's log-probs, whose one driver-side use, the step's log-prob gap metrics, the workers then answer as
numbers, ``gap``); a sent field that is one number per row on the response mask crosses as ``[B]``.

What stays: the request's ``prompts`` / ``prompt_mask`` and the rollout's answer (responses, masks, log-probs
and the rest of `PPOTrainer.response_fields`), which the driver also holds and never rewrites (a subclass
that rewrites one of them must set ``batch.resident_rows = None``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fusedrl.batch import RolloutBatch, padded_rows
from fusedrl.controller import WorkerGroup
from fusedrl.log_prob_gap import GapStats, gap_metrics
from fusedrl.resident import ResidentShard, row_values


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
        self.stay: tuple[str, ...] = ()  # fields a training generation leaves on the workers only (`staying`)
        self.log_prob_gap: dict[str, float] | None = None  # the last ``gap`` call's metrics

    @contextmanager
    def staying(self, fields: Sequence[str]) -> Iterator[None]:
        """Within: training generations leave ``fields`` (of those they keep) on the workers, not answered."""
        self.stay = tuple(fields)
        try:
            yield
        finally:
            self.stay = ()

    def request(
        self, group: Any, tp: int, step: int, validate: bool, fields: Sequence[str]
    ) -> tuple[int, int, tuple[str, ...]] | None:
        """The ``keep`` argument of one generation call: (generation id, step, the fields that stay there
        only); None for validation."""
        if validate or not self.enabled:
            return None
        self.count += 1
        self.generations = {g: v for g, v in self.generations.items() if v.step >= step}  # as the workers do
        self.generations[self.count] = Generation(group, tp, step, {"prompts", "prompt_mask", *fields})
        self.log_prob_gap = None  # a new training generation: its gap is still to measure
        return self.count, step, tuple(f for f in self.stay if f in fields)

    def holds(self, batch: RolloutBatch, name: str) -> bool:
        """Whether field ``name`` of every row of ``batch`` stays on the workers (kept there, not on the driver)."""
        rows = batch.resident_rows
        if rows is None or not self.enabled:
            return False
        made = [self.generations.get(int(g)) for g in set(rows[:, 0].tolist())]
        return all(m is not None and name in m.fields for m in made)

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
        self,
        group: Any,
        batch: RolloutBatch,
        names: Sequence[str],
        replicas: int,
        keep: str | None = None,
        gap: bool = False,
    ) -> tuple[list[ResidentShard], dict[int, dict[int, list[tuple[int, int, int]]]]] | None:
        """Each rank's `ResidentShard` of ``batch``'s fields ``names`` split as `WorkerGroup.run_split` splits
        (rank r: shard r // replicas), and the exports they need: ``{source rank: {rank: rows}}``; None
        where the batch's rows cannot be placed (no stamp, another group, a generation dropped). ``gap``:
        each shard answers the log-prob gap of its real rows (`ResidentShard.gap`)."""
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
        values, per_row = {n: getattr(batch, n) for n in sent}, {}
        for n, value in values.items():  # one number per row on the response mask: [B] crosses
            found = None if batch.response_mask is None else row_values(value, batch.response_mask)
            if found is not None:
                values[n], per_row[n] = found
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
            real = min(max(b - (rank // replicas) * chunk, 0), chunk) if gap else None  # padding left out
            sent_rows = {n: v[idx] for n, v in values.items()}
            out.append(ResidentShard(keys, local, sent_rows, keep, gap=real, per_row=dict(per_row)))
        return out, exports

    def run_split(
        self,
        group: WorkerGroup,
        call: Callable[[Any, Any], Any],
        batch: RolloutBatch,
        names: Sequence[str],
        replicas: int,
        keep: str | None = None,
        gap: bool = False,
    ) -> list[Any]:
        """`WorkerGroup.run_split` of ``batch``'s fields ``names``, resident where `shards` allows (then a
        ``keep`` answer stays on the workers and comes back as None). ``gap``: the answers (old log-probs)
        come back as the workers' `GapStats`, their metrics in ``log_prob_gap``; the rows must be placeable."""
        placed = self.shards(group, batch, names, replicas, keep, gap)
        if placed is None and gap:
            raise RuntimeError(
                "rollout_log_probs stayed on the workers that sampled them (fusedrl.resident), but the rows of "
                "this old-log-prob call cannot be placed there: keep them on their workers' group"
            )
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
            sources = sorted(exports)  # the export is not awaited here: the call's wait answers for it
            sent = group.send_shards(
                lambda w, rows: w.resident_export.remote(rows), sources, [exports[s] for s in sources]
            )
            for export, per_rank in zip(sent, (exports[s] for s in sources), strict=True):
                for rank in per_rank:
                    shards[rank].fetch.append((export, rank))
        results = group.run_shards(call, shards)[::replicas]
        if keep is not None:
            for g in set(batch.resident_rows[:, 0].tolist()):
                self.generations[int(g)].fields.add(keep)
        if gap:
            stats = [r[-1] if isinstance(r, tuple) else r for r in results]
            assert all(isinstance(s, GapStats) for s in stats), "a gap call answered no GapStats"
            self.log_prob_gap = gap_metrics(stats)
        return results
