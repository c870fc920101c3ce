"""Splitting rows by their real token counts: micro-batches within a token budget, and equal work per rank.

Both are pure functions of per-row lengths (real prompt + response tokens, padding excluded) and return
row indices; the callers index the batch with them and, where results come back per row, put them back
in the original order.

- `token_budget_bins` forms the micro-batches of dynamic batch size (``use_dynamic_bsz``): every
  micro-batch holds at most ``budget`` real tokens, so a forward's memory is bounded by tokens rather than
  by rows, and short rows share one forward.
- `balanced_rank_order` reorders a batch before the driver cuts it into equal-size per-rank chunks
  (``trainer.balance_batch``), so each data-parallel rank gets about the same number of tokens and no
  rank waits for the one that drew the long responses.

Both use the same greedy rule (longest first, into the least-loaded bin: "LPT", within 4/3 of the best
possible maximum load), deterministic for equal inputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from fusedrl.batch import RolloutBatch


def sequence_lengths(batch: RolloutBatch) -> list[int]:
    """Real (unpadded) prompt + response tokens of every row: ``[B]`` as a list."""
    lengths = batch.prompt_mask.sum(dim=1)  # [B]
    response = batch.response_mask if batch.response_attention_mask is None else batch.response_attention_mask
    if response is not None:
        lengths = lengths + response.sum(dim=1)  # [B], observation tokens included (they are computed on)
    return [int(x) for x in lengths.tolist()]


def _longest_first(lengths: Sequence[int]) -> list[int]:
    # Stable: equal lengths keep their row order, so the result is deterministic.
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def _greedy_bins(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Longest row first into the least-loaded bin (ties: lowest bin index). Rows ascending in a bin."""
    heap = [(0, b) for b in range(num_bins)]  # (load, bin)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in _longest_first(lengths):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(rows) for rows in bins]


def token_budget_bins(lengths: Sequence[int], budget: int, *, min_bins: int = 1) -> list[list[int]]:
    """Partition rows into micro-batches of at most ``budget`` tokens each.

    Starts from ``max(min_bins, ceil(sum / budget))`` bins (no fewer can fit) and adds bins until the
    greedy fill keeps every bin within the budget; it always succeeds by ``len(lengths)`` bins. Returns
    the bins (lists of row indices, ascending inside a bin; every row exactly once, no bin empty).
    ``min_bins`` lets data-parallel ranks agree on one count: FSDP's forward is a collective, so every
    rank must run the same number of micro-batches.
    """
    n = len(lengths)
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    too_long = [(i, x) for i, x in enumerate(lengths) if x > budget]
    if too_long:
        i, x = too_long[0]
        raise ValueError(
            f"row {i} has {x} tokens, more than the micro-batch token budget {budget}: raise the "
            "`*max_token_len_per_gpu` setting to at least max_prompt_length + max_response_length"
        )
    if min_bins > n:
        raise ValueError(f"cannot split {n} rows into {min_bins} non-empty micro-batches")
    if n == 0:
        return []
    num_bins = max(min_bins, math.ceil(sum(lengths) / budget), 1)
    while True:
        bins = _greedy_bins(lengths, num_bins)
        if all(sum(lengths[i] for i in rows) <= budget for rows in bins):
            return bins
        num_bins += 1


LOCALITY_SLACK = 0.01  # rows may stay home when the fullest rank then carries <= 1% more than balancing gives
HOME_SWAPS = 4  # at most this many group swaps from the home placement before balancing decides alone


def balanced_rank_order(
    lengths: Sequence[int],
    world_size: int,
    groups: Sequence[Sequence[int]] | None = None,
    home: Sequence[int] | None = None,
) -> list[int]:
    """A row permutation after which equal contiguous per-rank chunks carry about equal tokens.

    The chunks are those of `fusedrl.batch.split_for_ranks`: ``ceil(B / W)`` rows per rank, the last
    rank(s) taking what is left. Each rank keeps its exact row count; within a rank the rows stay in
    their original relative order. Returns indices ``order`` with ``batch[order]`` the balanced batch.

    ``groups`` (lists of row indices covering every row once, e.g. a prompt's samples): each group goes
    to one rank whole, heaviest group first onto the least-loaded rank with room for it, so a packed row
    can hold the group's prompt once (`fusedrl.workers.packing.pack_shared_prompts`); a group that fits
    no rank's remaining room is placed row by row as without ``groups``.

    ``home`` (the rank already holding each row, where rows stay on the workers that made them,
    `fusedrl.resident`): the rows stay there when that placement, or one at most `HOME_SWAPS` swaps of
    equal-sized groups away (each lowering the fullest rank), carries no more than `LOCALITY_SLACK` above
    the balanced placement's fullest rank: a moved row costs a worker-to-worker export.
    """
    n = len(lengths)
    if world_size <= 1 or n <= 1:
        return list(range(n))
    chunk = -(-n // world_size)  # ceil
    room = [max(0, min(chunk, n - r * chunk)) for r in range(world_size)]
    # Without groups every row is a group of its own: longest row first onto the least-loaded rank with room
    # (ties: lowest rank), the same greedy.
    units = [list(g) for g in groups] if groups is not None else [[i] for i in range(n)]
    load = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loose: list[int] = []  # rows of groups that fit no rank whole
    for group in sorted(units, key=lambda g: -sum(lengths[i] for i in g)):  # stable: ties keep their order
        fits = [(load[r], r) for r in range(world_size) if room[r] - len(ranks[r]) >= len(group)]
        if not fits:
            loose.extend(group)
            continue
        r = min(fits)[1]
        ranks[r].extend(group)
        load[r] += sum(lengths[i] for i in group)
    for i in sorted(loose, key=lambda i: -lengths[i]):
        r = min((load[r], r) for r in range(world_size) if len(ranks[r]) < room[r])[1]
        ranks[r].append(i)
        load[r] += lengths[i]
    if home is not None:
        ranks = _near_home(lengths, units, room, home, max(load) * (1 + LOCALITY_SLACK)) or ranks
    return [i for rows in ranks for i in sorted(rows)]


def _near_home(
    lengths: Sequence[int], units: list[list[int]], room: list[int], home: Sequence[int], limit: float
) -> list[list[int]] | None:
    """Each rank's rows when the groups stay on their ``home`` rank, after at most `HOME_SWAPS` swaps that
    each lower the fullest rank's tokens, if its fullest rank then carries at most ``limit``; else None (a
    group split over ranks, a home placement of other sizes than ``room``, or no such placement)."""
    world = len(room)
    where: list[int] = []
    for unit in units:
        homes = {home[i] for i in unit}
        if len(homes) != 1 or not 0 <= next(iter(homes)) < world:
            return None
        where.append(homes.pop())
    members = [[k for k, r in enumerate(where) if r == rank] for rank in range(world)]
    if [sum(len(units[k]) for k in m) for m in members] != room:
        return None
    weight = [sum(lengths[i] for i in unit) for unit in units]
    load = [sum(weight[k] for k in m) for m in members]
    for _ in range(HOME_SWAPS + 1):
        if max(load) <= limit:
            return [[i for k in m for i in units[k]] for m in members]
        hi = max(range(world), key=lambda r: (load[r], -r))
        best: tuple[int, int, int, int] | None = None  # (new peak of the two ranks, rank, out, in)
        for lo in range(world):
            for a in members[hi] if lo != hi else ():
                for b in members[lo]:
                    moved = weight[a] - weight[b]
                    if len(units[a]) != len(units[b]) or moved <= 0:
                        continue
                    peak = max(load[hi] - moved, load[lo] + moved)
                    if peak < load[hi] and (best is None or peak < best[0]):
                        best = (peak, lo, a, b)
        if best is None:
            return None
        _, lo, a, b = best
        members[hi][members[hi].index(a)] = b
        members[lo][members[lo].index(b)] = a
        load[hi] += weight[b] - weight[a]
        load[lo] += weight[a] - weight[b]
    return None


def rank_token_loads(lengths: Sequence[int], world_size: int) -> list[int]:
    """Tokens each rank receives when rows are cut into `split_for_ranks`' contiguous chunks."""
    n = len(lengths)
    chunk = max(1, -(-n // max(world_size, 1)))
    return [sum(lengths[r * chunk : (r + 1) * chunk]) for r in range(world_size)]


def apply_order(batch: RolloutBatch, order: Sequence[int]) -> RolloutBatch:
    """``batch`` with its rows in ``order`` (every field, tensor or not)."""
    return batch[torch.tensor(list(order), dtype=torch.long)]


def balance_over_ranks(
    batch: RolloutBatch,
    world_size: int,
    *,
    reorder: bool,
    groups_whole: bool,
    home: Sequence[int] | None = None,
) -> tuple[RolloutBatch, float]:
    """``batch`` reordered so each of ``world_size`` contiguous shards carries about the same real tokens
    (when ``reorder``), and the largest shard's tokens over the mean. With ``groups_whole`` the rows of one
    ``uid`` go to one rank together (packed rows hold their shared prompt once); ``home``: each row's rank
    now (`balanced_rank_order` keeps rows there where that balances about as well)."""
    lengths = sequence_lengths(batch)
    if reorder and world_size > 1:
        groups = None
        if groups_whole and batch.uid is not None:
            by_uid: dict[str, list[int]] = {}
            for row, uid in enumerate(batch.uid):
                by_uid.setdefault(str(uid), []).append(row)
            groups = list(by_uid.values())
        order = balanced_rank_order(lengths, world_size, groups, home)
        batch = apply_order(batch, order)
        lengths = [lengths[i] for i in order]
    loads = rank_token_loads(lengths, world_size)
    return batch, max(loads) / max(sum(loads) / world_size, 1.0)
