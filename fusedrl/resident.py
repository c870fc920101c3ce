"""Fields that stay on the worker that made them (issue 39 item 3: data stays where it was made).

A rollout worker keeps the rows it generated (the request's prompts and masks, its responses, masks and
log-probs) in its `fusedrl.workers.resident_store.ResidentStore`, under a generation id; the driver's batch
records, per row, where those live (``RolloutBatch.resident_rows``: generation, engine, row in that engine's
shard). When the driver sends a batch to the ranks of the worker group that generated it (the fused pool),
it sends a `ResidentShard` instead of the rows: the row keys (plain ints, not tensors), the fields the
worker reads from its store, and only the tensors the worker does not hold (e.g. the advantages). Rows a rank
needs that another engine made (balancing across ranks, the padding of a split) move worker to worker: their
maker puts them in Ray's object store and the shard carries the references, so they never reach the driver.
An answer may stay on the worker too (``keep``: the reference's log-probs, which the update then reads there).
Anything else (another pool, a batch without ``resident_rows``: async and partial rollouts) takes the
transfer path, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ResidentShard:
    """One rank's shard of a call whose fields partly stay on the worker.

    ``rows``: per row of the shard, ``(generation, engine, row)``: the engine that made it and its row in that
    engine's shard; ``local``: fields read from the worker's store; ``sent``: the other fields' ``[b, ...]``
    tensors; ``keep``: store the call's ``[b, ...]`` answer under that field name and answer None; ``fetch``:
    object references to rows made by other engines (exported by their workers), added to the store first."""

    rows: list[tuple[int, int, int]]
    local: tuple[str, ...]
    sent: dict[str, Any] = field(default_factory=dict)
    keep: str | None = None
    fetch: list[Any] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.rows)
