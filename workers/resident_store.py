"""The rows a worker generated, kept where they were made (`fusedrl.resident`).

`keep` stores a generation's fields (``[n, ...]`` tensors on the CPU, n the rows of this worker's shard,
padding included) and drops the generations of earlier steps; `resolve` turns a `ResidentShard` into the
`RolloutBatch` the role computes on (fields from the store in the shard's row order, plus those sent);
`answer` stores a call's answer under the shard's ``keep`` name instead of sending it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.resident import ResidentShard


class ResidentStore:
    """Per generation id: its step, and each kept field's ``[n, ...]`` tensor with a ``[n]`` bool 'set' mask."""

    def __init__(self) -> None:
        self.step: dict[int, int] = {}
        self.fields: dict[int, dict[str, torch.Tensor]] = {}
        self.has: dict[int, dict[str, torch.Tensor]] = {}

    def keep(self, generation: int, step: int, values: Mapping[str, Any]) -> None:
        """Store one generation's tensors (non-tensor values are not kept) and drop earlier steps'."""
        for old in [g for g, s in self.step.items() if s < step]:
            self.drop(old)
        tensors = {k: v.detach().cpu() for k, v in values.items() if isinstance(v, torch.Tensor)}
        self.step[generation] = step
        self.fields[generation] = tensors
        self.has[generation] = {k: torch.ones(v.shape[0], dtype=torch.bool) for k, v in tensors.items()}

    def drop(self, generation: int) -> None:
        for table in (self.step, self.fields, self.has):
            table.pop(generation, None)

    def _index(self, shard: ResidentShard, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per generation in the shard: (positions in the shard, rows in the store) of field ``name``."""
        by_gen: dict[int, tuple[list[int], list[int]]] = {}
        for pos, (gen, row) in enumerate(shard.rows):
            if gen not in self.fields:
                raise KeyError(
                    f"resident rows of generation {gen} are not on this worker (kept: {sorted(self.fields)}); "
                    "the driver sends such rows instead (fusedrl.resident)"
                )
            by_gen.setdefault(gen, ([], []))[0].append(pos)
            by_gen[gen][1].append(row)
        out = []
        for gen, (positions, rows) in by_gen.items():
            index = torch.tensor(rows, dtype=torch.long)
            has = self.has[gen].get(name)
            if has is None or not bool(has[index].all()):
                raise KeyError(f"field {name!r} of generation {gen} is not kept on this worker for every row")
            out.append((torch.tensor(positions, dtype=torch.long), index))
        return out

    def read(self, shard: ResidentShard, name: str) -> torch.Tensor:
        """Field ``name`` of the shard's rows, ``[b, ...]`` in the shard's order."""
        parts = self._index(shard, name)
        first = self.fields[shard.rows[0][0]][name]
        out = torch.empty((shard.num_rows, *first.shape[1:]), dtype=first.dtype)
        for positions, index in parts:
            gen = shard.rows[int(positions[0])][0]
            out[positions] = self.fields[gen][name][index]
        return out

    def resolve(self, batch: RolloutBatch | ResidentShard) -> RolloutBatch:
        """The batch a role computes on: ``batch`` itself, or a resident shard's rows read and merged."""
        if not isinstance(batch, ResidentShard):
            return batch
        values = {name: self.read(batch, name) for name in batch.local}
        values.update(batch.sent)
        out = RolloutBatch(
            prompts=values.pop("prompts"), prompt_mask=values.pop("prompt_mask"), batch_size=[batch.num_rows]
        )
        for name, value in values.items():
            setattr(out, name, value)
        return out

    def answer(self, batch: RolloutBatch | ResidentShard, value: torch.Tensor) -> torch.Tensor | None:
        """``value`` (``[b, ...]``, the shard's rows), or None once stored under the shard's ``keep`` name."""
        if not isinstance(batch, ResidentShard) or batch.keep is None:
            return value
        value = value.detach().cpu()
        for gen in {g for g, _ in batch.rows}:
            n = next(iter(self.fields[gen].values())).shape[0]
            if batch.keep not in self.fields[gen]:
                self.fields[gen][batch.keep] = torch.zeros((n, *value.shape[1:]), dtype=value.dtype)
                self.has[gen][batch.keep] = torch.zeros(n, dtype=torch.bool)
        for pos, (gen, row) in enumerate(batch.rows):
            self.fields[gen][batch.keep][row] = value[pos]
            self.has[gen][batch.keep][row] = True
        return None
