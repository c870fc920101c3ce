"""The rows a worker generated, kept where they were made (`fusedrl.resident`).

Rows are blocks per (generation, engine): `keep` stores this worker's engine's shard of a generation
(``[n, ...]`` CPU tensors, padding included) and drops the generations of earlier steps; `export` puts rows
another rank needs into Ray's object store (worker to worker: they never reach the driver); `resolve` turns a
`ResidentShard` into the `RolloutBatch` the role computes on (its fetched rows added to their blocks first);
`answer` stores a call's answer under the shard's ``keep`` name instead of sending it back, and answers the
rollout-vs-actor log-prob gap as numbers where the shard asks (``gap``). Each field of a block has a ``[n]`` bool mask of the rows it holds: a row it does not hold is refused, by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.log_prob_gap import GapStats, gap_stats
from fusedrl.resident import ResidentShard, on_mask

Key = tuple[int, int]  # (generation, engine)


class ResidentStore:
    """Per (generation, engine): each kept field's ``[n, ...]`` tensor and its ``[n]`` bool 'held' mask."""

    def __init__(self, engine: int = 0) -> None:
        self.engine = engine  # this worker's rollout engine (data-parallel shard of a generation)
        self.step: dict[int, int] = {}  # generation -> its step
        self.size: dict[Key, int] = {}
        self.fields: dict[Key, dict[str, torch.Tensor]] = {}
        self.has: dict[Key, dict[str, torch.Tensor]] = {}

    def keep(self, generation: int, step: int, values: Mapping[str, Any]) -> None:
        """Store this engine's shard of one generation (non-tensor values are not kept); drop earlier steps'."""
        for key in [k for k in self.fields if self.step.get(k[0], step) < step]:
            self.drop(key)
        tensors = {k: v.detach().cpu() for k, v in values.items() if isinstance(v, torch.Tensor)}
        key = (generation, self.engine)
        self.step[generation] = step
        self.size[key] = next(iter(tensors.values())).shape[0]
        self.fields[key] = tensors
        self.has[key] = {k: torch.ones(v.shape[0], dtype=torch.bool) for k, v in tensors.items()}

    def drop(self, key: Key) -> None:
        for table in (self.size, self.fields, self.has):
            table.pop(key, None)

    def _groups(self, rows: Sequence[tuple[int, int, int]]) -> dict[Key, tuple[list[int], list[int]]]:
        """Per block: (positions in ``rows``, rows in the block)."""
        out: dict[Key, tuple[list[int], list[int]]] = {}
        for pos, (gen, engine, row) in enumerate(rows):
            if (gen, engine) not in self.fields:
                raise KeyError(
                    f"resident rows of generation {gen}, engine {engine} are not on this worker (held: "
                    f"{sorted(self.fields)}); the driver sends or fetches such rows (fusedrl.resident)"
                )
            out.setdefault((gen, engine), ([], []))[0].append(pos)
            out[(gen, engine)][1].append(row)
        return out

    def read(self, rows: Sequence[tuple[int, int, int]], name: str) -> torch.Tensor:
        """Field ``name`` of ``rows`` ((generation, engine, row) each), ``[b, ...]`` in that order."""
        out: torch.Tensor | None = None
        for key, (positions, block_rows) in self._groups(rows).items():
            index = torch.tensor(block_rows, dtype=torch.long)
            has = self.has[key].get(name)
            if has is None or not bool(has[index].all()):
                raise KeyError(
                    f"field {name!r} of generation {key[0]}, engine {key[1]} is not held for every row"
                )
            value = self.fields[key][name][index]
            if out is None:
                out = torch.empty((len(rows), *value.shape[1:]), dtype=value.dtype)
            out[torch.tensor(positions, dtype=torch.long)] = value
        assert out is not None, "a resident shard of no rows"
        return out

    def _put(self, rows: Sequence[tuple[int, int, int]], name: str, value: torch.Tensor) -> None:
        """Set field ``name`` of ``rows`` to ``value`` (``[b, ...]``), making room in their blocks."""
        for key, (positions, block_rows) in self._groups(rows).items():
            n = self.size[key]
            if name not in self.fields[key]:
                self.fields[key][name] = torch.zeros((n, *value.shape[1:]), dtype=value.dtype)
                self.has[key][name] = torch.zeros(n, dtype=torch.bool)
            index = torch.tensor(block_rows, dtype=torch.long)
            self.fields[key][name][index] = value[torch.tensor(positions, dtype=torch.long)]
            self.has[key][name][index] = True

    def payload(self, rows: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
        """``rows`` with every field this worker holds for all of them, as `fetch` takes them."""
        blocks = self._groups(rows)
        held = [
            n
            for n in self.fields[next(iter(blocks))]
            if all(
                n in self.has[k] and bool(self.has[k][n][torch.tensor(r)].all())
                for k, (_, r) in blocks.items()
            )
        ]
        return {
            "rows": list(rows),
            "sizes": {k: self.size[k] for k in blocks},
            "steps": {k[0]: self.step[k[0]] for k in blocks},
            "fields": {n: self.read(rows, n) for n in held},
        }

    def export(self, wanted: Mapping[int, Sequence[tuple[int, int, int]]]) -> dict[int, Any]:
        """Per destination rank, an object reference to its `payload` of ``wanted[rank]`` (worker to worker)."""
        return {dest: ray.put(self.payload(rows)) for dest, rows in wanted.items()}

    def fetch(self, payload: Mapping[str, Any]) -> None:
        """Add rows exported by another worker to their blocks here."""
        for key, size in payload["sizes"].items():
            if key not in self.fields:
                self.size[key], self.fields[key], self.has[key] = size, {}, {}
        self.step.update(payload["steps"])
        for name, value in payload["fields"].items():
            self._put(payload["rows"], name, value)

    def resolve(self, batch: RolloutBatch | ResidentShard) -> RolloutBatch:
        """The batch a role computes on: ``batch`` itself, or a resident shard's rows read and merged."""
        if not isinstance(batch, ResidentShard):
            return batch
        for export, rank in batch.fetch:  # the exporting worker ran its export before its own call
            self.fetch(ray.get(ray.get(export)[rank]))
        batch.fetch = []  # fetched once (the call may resolve its shard again)
        values = {name: self.read(batch.rows, name) for name in batch.local}
        values.update(batch.sent)
        for name, form in batch.per_row.items():  # [b] -> [b, Tr] on the rows' response mask, bit for bit
            mask = values.get("response_mask")
            mask = self.read(batch.rows, "response_mask") if mask is None else mask
            values[name] = on_mask(values[name], mask, form)
        out = RolloutBatch(
            prompts=values.pop("prompts"), prompt_mask=values.pop("prompt_mask"), batch_size=[batch.num_rows]
        )
        for name, value in values.items():
            setattr(out, name, value)
        return out

    def answer(
        self, batch: RolloutBatch | ResidentShard, value: torch.Tensor
    ) -> torch.Tensor | GapStats | None:
        """``value`` (``[b, ...]``, the shard's rows); None once stored under the shard's ``keep`` name; with
        the shard's ``gap``, the gap of the held ``rollout_log_probs`` to ``value`` (old log-probs) instead."""
        if not isinstance(batch, ResidentShard):
            return value
        if batch.keep is not None:
            self._put(batch.rows, batch.keep, value.detach().cpu())
        if batch.gap is not None:
            rows, n = batch.rows[: batch.gap], batch.gap
            if n == 0:
                return gap_stats(value[:0], value[:0], value[:0])
            rollout, mask = self.read(rows, "rollout_log_probs"), self.read(rows, "response_mask")
            return gap_stats(rollout, value[:n].detach().cpu(), mask)
        return None if batch.keep is not None else value
