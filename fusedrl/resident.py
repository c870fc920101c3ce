"""Fields that stay on the worker that made them (issue 39 item 3: data stays where it was made).

A rollout worker keeps the rows it generated (the request's prompts and masks, its responses, masks and
log-probs) in its `fusedrl.workers.resident_store.ResidentStore`, under a generation id; the driver's batch
records, per row, where those live (``RolloutBatch.resident_rows``: generation, engine, row in that engine's
shard). When the driver sends a batch to the ranks of the worker group that generated it (the fused pool),
it sends a `ResidentShard` instead of the rows: the row keys (plain ints, not tensors), the fields the
worker reads from its store, and only the tensors the worker does not hold (e.g. the advantages). Rows a rank
needs that another engine made (balancing across ranks, the padding of a split) move worker to worker: their
maker puts them in Ray's object store and the shard carries the references, so they never reach the driver.
An answer may stay on the worker too (``keep``: the reference's log-probs, which the update then reads there),
or come back as the numbers the driver reduces it to (``gap``: the rollout-vs-actor log-prob gap of old
log-probs, `fusedrl.log_prob_gap`). A sent ``[B, Tr]`` field that is one number per row on the response mask
(the advantages of outcome-reward estimators: GRPO, RLOO, ...) crosses as ``[B]`` (`row_values`) and is
rebuilt bit for bit on the worker (`on_mask`). Anything else (another pool, a batch without ``resident_rows``: async and partial rollouts) takes the
transfer path, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ResidentShard:
    """One rank's shard of a call whose fields partly stay on the worker.

    ``rows``: per row of the shard, ``(generation, engine, row)``: the engine that made it and its row in that
    engine's shard; ``local``: fields read from the worker's store; ``sent``: the other fields' ``[b, ...]``
    tensors; ``keep``: store the call's ``[b, ...]`` answer under that field name and answer None; ``fetch``:
    rows made by other engines, added to the store first: ``(export, rank)`` pairs, ``export`` the object reference
    to a `WorkerDict.resident_export` call's answer (``{rank: reference to the rows}``) on the worker that holds them;
    ``gap``: answer the `fusedrl.log_prob_gap.GapStats` of the held ``rollout_log_probs`` against the call's
    ``[b, Tr]`` answer over the first ``gap`` rows (the rest are a split's padding) instead of the answer;
    ``per_row``: sent fields given as ``[b]``, one number per row, and how `on_mask` rebuilds them."""

    rows: list[tuple[int, int, int]]
    local: tuple[str, ...]
    sent: dict[str, Any] = field(default_factory=dict)
    keep: str | None = None
    fetch: list[Any] = field(default_factory=list)
    gap: int | None = None
    per_row: dict[str, str] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def on_mask(values: torch.Tensor, mask: torch.Tensor, form: str) -> torch.Tensor:
    """``[B, T]`` from one number per row ``values [B]`` on ``mask [B, T]``: ``"times"``,
    ``values[:, None] * mask`` (how the outcome estimators broadcast: -0.0 off the mask of a negative row);
    ``"where"``, ``values`` on the mask and 0 off it."""
    if form == "times":
        return values[:, None] * mask.to(values.dtype)
    return torch.where(mask.bool(), values[:, None], torch.zeros((), dtype=values.dtype))


def row_values(value: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """``(values [B], form)`` when the floating ``value [B, T]`` is exactly (every bit) `on_mask` of one number
    per row (each row's value at its first masked token; 0 where it has none), else None. Decided on the data:
    any estimator whose advantages are a broadcast qualifies."""
    if not value.is_floating_point() or value.shape != mask.shape or value.dim() != 2:
        return None
    first = mask.bool().to(torch.uint8).argmax(dim=1, keepdim=True)  # [B, 1]: the first masked token
    values = value.gather(1, first).squeeze(1)  # [B]
    bits = value.contiguous().view(torch.uint8)
    for form in ("times", "where"):
        if torch.equal(on_mask(values, mask, form).contiguous().view(torch.uint8), bits):
            return values, form
    return None
