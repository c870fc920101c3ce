"""What a generation call sends each rollout engine, and what it answers (issue 39 item 3).

The driver's rows of one generation call (prompts repeated ``n`` times, their sampling seeds) used to cross
Ray as three tensors per call (``prompts``, ``prompt_mask``, ``sample_seeds``) and come back as
``responses`` / ``response_mask`` (and the rest of the answer). Now:

* the seeds do not travel: a row's seed is a function of (``rollout.seed``, step, round, row) (`row_seeds`,
  which `fusedrl.trainer.step_plan.sample_seeds` calls), so each shard carries those three ints and the
  global row of its first row (`SeedRows`), and the worker computes its rows' seeds itself, the same values;
* the prompts and their mask cross as one ragged tensor (`fusedrl.ragged`), rebuilt on the worker as the
  driver holds them (left padding, the batch's width, the pad id);
* a single-turn answer's ``responses`` / ``response_mask`` come back as one ragged tensor (`wire_answer`),
  rebuilt by `expand_answer` (`WorkerGroup.gather_fields`) at the width they had.

Where the encoding is not exact (`fusedrl.ragged.pack` answers None: a mask with holes) the padded tensors
cross as before. A batch sent whole (validation of tests, the partial-rollout trainer's rows, explicit seeds)
still works: `request_batch` passes a `RolloutBatch` through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fusedrl.batch import NON_TENSOR_FIELDS, RolloutBatch, split_for_ranks
from fusedrl.ragged import RaggedRows, pack

SEED_MODULUS = 2**31 - 1


def row_seeds(rollout_seed: int, step: int, round_index: int, rows: torch.Tensor) -> torch.Tensor:
    """The sampling seed of each global row in ``rows`` of the generation call of (``rollout.seed``, step,
    round): ``[len(rows)]`` int64; rows ``arange(B)`` give `fusedrl.trainer.step_plan.sample_seeds`."""
    base = rollout_seed * 1_000_003 + step * 10_007 + round_index * 101
    return (base + rows.long() * 7919) % SEED_MODULUS


@dataclass(frozen=True)
class SeedRows:
    """The seeds of a shard's rows, as plain ints: global row ``first + i`` (modulo ``total``: the padding of
    a split repeats the first rows, `fusedrl.batch.padded_rows`) of the call (``rollout_seed``, ``step``,
    ``round_index``) of ``total`` rows."""

    rollout_seed: int
    step: int
    round_index: int
    total: int
    first: int = 0

    def seeds(self, rows: int) -> torch.Tensor:
        """``[rows]`` int64: the seeds of this shard's ``rows`` rows."""
        index = (self.first + torch.arange(rows, dtype=torch.long)) % max(self.total, 1)
        return row_seeds(self.rollout_seed, self.step, self.round_index, index)


@dataclass
class RequestShard:
    """One engine's rows of a generation call: ``prompts`` packed with their mask (None: the padded pair is in
    ``fields``), ``fields`` the other fields sent (images, the agent loops' row values), ``seeds``."""

    rows: int
    prompts: RaggedRows | None
    seeds: SeedRows
    fields: dict[str, Any] = field(default_factory=dict)

    def batch(self) -> RolloutBatch:
        """The rows as the driver's `RolloutBatch` holds them, with their ``sample_seeds``."""
        values = dict(self.fields)
        if self.prompts is not None:
            values["prompts"], values["prompt_mask"] = self.prompts.unpack()
        out = RolloutBatch(
            prompts=values.pop("prompts"), prompt_mask=values.pop("prompt_mask"), batch_size=[self.rows]
        )
        for name, value in values.items():
            setattr(out, name, value)
        out.sample_seeds = self.seeds.seeds(self.rows)
        return out


@dataclass
class RolloutRequest:
    """A generation call's rows: ``rows`` holds the fields ``names`` to send (no seeds), ``seeds`` their
    (seed, step, round); `WorkerGroup.run_split` / `submit_split` cut it per engine with `shards_for`, as they
    cut a batch (`fusedrl.batch.split_for_ranks`: the same rows, the same padding)."""

    rows: RolloutBatch
    names: tuple[str, ...]
    seeds: SeedRows

    @property
    def num_samples(self) -> int:
        return self.rows.num_samples

    def shards_for(self, n_shards: int) -> list[RequestShard]:
        """One `RequestShard` per engine: its rows' prompts packed, the other fields, its first global row."""
        shards, _ = split_for_ranks(self.rows, n_shards)
        out, first = [], 0
        for shard in shards:
            prompts = pack(shard.prompts, shard.prompt_mask, left=True, mask_name="prompt_mask")
            names = [n for n in self.names if prompts is None or n not in ("prompts", "prompt_mask")]
            fields = {
                n: list(getattr(shard, n)) if n in NON_TENSOR_FIELDS else getattr(shard, n) for n in names
            }
            out.append(RequestShard(shard.num_samples, prompts, replace(self.seeds, first=first), fields))
            first += shard.num_samples
        return out


GenerationInput = RequestShard | RolloutBatch  # what `WorkerDict.rollout_generate_fields` is sent


def request_batch(request: GenerationInput) -> RolloutBatch:
    """The worker's batch of a generation call: a `RequestShard` rebuilt, a batch sent whole as it is."""
    return request.batch() if isinstance(request, RequestShard) else request


RAGGED_ANSWERS = {"responses": "response_mask"}  # an answer's field packed with its mask (right padding)


def wire_answer(answer: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A generation answer as it crosses back: ``responses`` and ``response_mask`` as one `RaggedRows` under
    ``responses`` where exact and the rows have no ``response_attention_mask`` (multi-turn); else as is."""
    out: dict[str, Any] = dict(answer)
    if "response_attention_mask" in out:
        return out
    for name, mask in RAGGED_ANSWERS.items():
        if name in out and mask in out:
            packed = pack(out[name], out[mask], left=False, mask_name=mask)
            if packed is not None:
                out[name] = packed
                del out[mask]
    return out


def expand_answer(answer: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`wire_answer`'s inverse: each `RaggedRows` back into its padded field and mask."""
    out: dict[str, torch.Tensor] = {}
    for name, value in answer.items():
        if isinstance(value, RaggedRows):
            out[name], out[value.mask] = value.unpack()
        else:
            out[name] = value
    return out
