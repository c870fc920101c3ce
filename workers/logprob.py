"""Per-token log-probabilities of responses under a causal LM, computed the way the rollout samples.

The rollout engine samples from ``softmax(logits / temperature)`` and reports that distribution's
log-probs (vLLM's ``processed_logprobs``). The trainer must score with the same distribution, so logits
are divided by the rollout temperature here too; otherwise the PPO ratio and the first-step KL would be
off by the temperature alone.

Two ways to cut a batch into forwards: ``rows`` per micro-batch, or, with dynamic batch size, micro-batches
of at most ``max_token_len`` real tokens (`split_micro_batches`). Two ways to run a forward: padded
(``[b, Tp+Tr]`` with an attention mask) or packed (``remove_padding``: see `fusedrl.workers.packing`).
All four combinations give the same numbers up to floating-point summation order.

The LM head and the softmax statistics run in chunks of positions when a micro-batch's logits would be
large (`fusedrl.workers.chunked_head`): the model returns per-token results instead of ``[M, V]`` logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.balance import sequence_lengths, token_budget_bins
from fusedrl.batch import RolloutBatch
from fusedrl.workers.chunked_head import head_log_probs
from fusedrl.workers.fsdp import gathered_for_pass
from fusedrl.workers.layer_compile import has_compiled_layers
from fusedrl.workers.packing import can_share_prompts, pack_batch, prompt_groups
from fusedrl.workers.routing_replay import RoutingUse, routed_forward
from fusedrl.workers.ulysses import ulysses_response_log_probs

B = TypeVar("B", RolloutBatch, dict)

# Drop the columns that are padding in every row of a padded micro-batch before its forward (exact; see
# `response_log_probs`). A module switch only so benchmarks can measure the untrimmed forward side by side.
TRIM_PADDING = True


def micro_batches(batch: B, size: int) -> Iterator[B]:
    """Consecutive slices of at most ``size`` rows of a `RolloutBatch` or a dict of ``[B, ...]`` tensors
    (the SFT batch): the one row micro-batcher of every role."""
    if size <= 0:
        raise ValueError(f"micro-batch size must be positive, got {size}")
    if isinstance(batch, dict):
        rows = int(next(iter(batch.values())).shape[0])
        for start in range(0, rows, size):
            yield {k: v[start : start + size] for k, v in batch.items()}  # type: ignore[misc]
        return
    for start in range(0, batch.num_samples, size):
        yield batch[start : start + size]


def split_micro_batches(
    batch: RolloutBatch, *, rows: int, max_token_len: int | None = None, share_prompts: bool = False
) -> tuple[list[RolloutBatch], torch.Tensor]:
    """The micro-batches of one pass over ``batch`` and ``order`` ``[B]``: the original row index of each
    row of ``cat(micro-batches)`` (so ``out[order] = cat(results)`` restores the batch's row order).

    ``max_token_len=None``: consecutive slices of ``rows`` rows. Otherwise (dynamic batch size) ``rows`` is
    ignored and rows are grouped into micro-batches of at most ``max_token_len`` real tokens. The number of
    micro-batches is agreed across data-parallel ranks (the largest any rank needs), because every FSDP
    forward is a collective: a rank that ran one forward fewer would hang the others.
    """
    if max_token_len is None:
        return list(micro_batches(batch, rows)), torch.arange(batch.num_samples)
    lengths = sequence_lengths(batch)
    # With shared prompts, whole prompt groups (empty: fill row by row)
    units, unit_lengths = shared_prompt_units(batch, lengths, max_token_len) if share_prompts else ([], [])

    def bins_of(min_bins: int = 1) -> list[list[int]]:
        if units and min_bins <= len(units):
            unit_bins = token_budget_bins(unit_lengths, max_token_len, min_bins=min_bins)
            return [sorted(i for u in b for i in units[u]) for b in unit_bins]
        return token_budget_bins(lengths, max_token_len, min_bins=min_bins)

    bins = bins_of()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank takes the largest count; the greedy fill may need more bins than asked on some rank,
        # so repeat until all counts are equal. The exit test uses only all-reduced numbers: every rank
        # runs the same number of rounds (one rank leaving early would pair collectives wrongly and hang).
        while True:
            # [max, -min] after the reduce; on the batch's device, as NCCL reduces device tensors only
            count = torch.tensor(
                [len(bins), -len(bins)], dtype=torch.int64, device=batch.response_mask.device
            )
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            most, fewest = int(count[0]), -int(count[1])
            if most == fewest:
                break
            bins = bins_of(most)
    order = torch.tensor([i for rows_of_bin in bins for i in rows_of_bin], dtype=torch.long)  # [B]
    return [batch[torch.tensor(b, dtype=torch.long)] for b in bins], order


def shared_prompt_units(
    batch: RolloutBatch, lengths: list[int], max_token_len: int
) -> tuple[list[list[int]], list[int]]:
    """With shared prompts, token-budget micro-batches are filled with whole groups of rows that share a
    prompt (`fusedrl.workers.packing.prompt_groups`), each counted at its packed size (the prompt once):
    ``(groups, tokens per group)``, or ``([], [])`` (fill row by row) when a group exceeds the budget."""
    units = prompt_groups(batch)
    prompt_tokens = batch.prompt_mask.sum(1).tolist()  # [b]
    sizes = [sum(lengths[i] for i in g) - (len(g) - 1) * int(prompt_tokens[g[0]]) for g in units]
    return ([], []) if max(sizes, default=0) > max_token_len else (units, sizes)


def token_budget(use_dynamic_bsz: bool, max_token_len: int) -> int | None:
    """``max_token_len`` when a role's ``use_dynamic_bsz`` key turns token-budget micro-batches on, else
    None (row micro-batches)."""
    return int(max_token_len) if use_dynamic_bsz else None


def restore_order(parts: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
    """Per-micro-batch ``[b_i, ...]`` results of `split_micro_batches` -> ``[B, ...]`` in batch order."""
    stacked = torch.cat(parts, dim=0)  # [B, ...] in micro-batch order
    out = torch.empty_like(stacked)
    out[order] = stacked
    return out


def kept_columns(batch: RolloutBatch) -> tuple[int, int]:
    """``(first prompt column, response columns)`` that a padded forward keeps (all without `TRIM_PADDING`).

    Columns that are padding in every row change nothing (positions count real tokens; masked keys get no
    attention weight) but cost a full forward/backward each: prompts are left-padded to
    data.max_prompt_length, responses right-padded to the longest allowed. Keep >= 1 column of each."""
    prompt_len, resp_len = batch.prompts.shape[1], batch.responses.shape[1]
    if not TRIM_PADDING:
        return 0, resp_len
    first = min(int(batch.prompt_mask.any(0).float().argmax()), prompt_len - 1)
    last = max(int(batch.response_mask.any(0).nonzero().max()) + 1 if batch.response_mask.any() else 1, 1)
    return first, last


def response_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    with_entropy: bool = False,
    remove_padding: bool = False,
    with_sum_pi_squared: bool = False,
    sp_group: Any = None,
    share_prompts: bool = False,
    routing: RoutingUse | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over prompt+response; returns ``(log_probs [B, Tr], entropy [B, Tr] | None)``, or with
    ``with_sum_pi_squared`` ``(log_probs, Σπ² [B, Tr])``. ``sp_group``: Ulysses sequence parallelism over
    that group (packed; `fusedrl.workers.ulysses`), every rank of it passing the same ``batch``.

    Runs with whatever grad mode the caller set: under ``torch.no_grad`` for old/ref log-probs, with
    grad inside the actor update. With ``remove_padding`` the rows are packed into one sequence and the
    results are 0 on response padding; padded, the values on padding are meaningless (callers mask).
    ``share_prompts`` (with ``remove_padding``, ``model.share_prompt_prefix``): rows with the same prompt
    share one copy of it in the packed row, where the model runs fusedrl's CPU attention (elsewhere the
    rows are packed whole; see `fusedrl.workers.packing.pack_shared_prompts`). ``routing``: what the forward
    does with the batch's ``routed_experts`` when it has them (routing replay, `_routed`).
    """
    if routing is not None and batch.routed_experts is not None:
        return _routed(
            model,
            batch,
            routing,
            temperature=temperature,
            with_entropy=with_entropy,
            remove_padding=remove_padding,
            with_sum_pi_squared=with_sum_pi_squared,
            sp_group=sp_group,
        )
    if sp_group is not None:
        return ulysses_response_log_probs(
            model,
            batch,
            sp_group,
            temperature=temperature,
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared,
            grad_scale=float(dist.get_world_size(sp_group)),  # FSDP averages over the group: see ulysses
        )
    if remove_padding:
        share = share_prompts and can_share_prompts(model)
        packed = pack_batch(batch, layout=has_compiled_layers(model), share_prompts=share)
        log_probs, entropy = head_log_probs(
            model,
            lambda: packed.response_logits(model),  # [M, V]
            packed.targets,
            temperature=temperature,
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared,
        )  # [M] each
        return packed.unpack(log_probs), None if entropy is None else packed.unpack(entropy)  # [B, Tr]
    input_ids, attention_mask, position_ids = batch.sequences()  # [B, Tp+Tr] each
    prompt_len, resp_len = batch.prompts.shape[1], batch.responses.shape[1]
    first, last = kept_columns(batch)
    if TRIM_PADDING:
        input_ids, attention_mask, position_ids = (
            t[:, first : prompt_len + last] for t in (input_ids, attention_mask, position_ids)
        )  # [B, Tp' + Tr'] each
    # The token at position t is predicted by the logits at t-1: the response tokens by the Tr' positions
    # before the last. The LM head runs on those positions only (``logits_to_keep``): on the prompt's it
    # would be wasted, a large share of the forward for a model with a large vocabulary.
    width = input_ids.shape[1]
    keep = torch.arange(width - 1 - last, width - 1, device=input_ids.device)  # [Tr']
    log_probs, entropy = head_log_probs(
        model,
        lambda: (
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=keep,
            ).logits
        ),  # [B, Tr', V]
        batch.responses[:, :last],
        temperature=temperature,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )  # [B, Tr'] each
    if last < resp_len:  # back to the batch's [B, Tr]; the trimmed columns are padding (callers mask)
        log_probs, entropy = (
            None if t is None else torch.nn.functional.pad(t, (0, resp_len - last))
            for t in (log_probs, entropy)
        )
    return log_probs, entropy  # [B, Tr] each


def _routed(
    model: nn.Module, batch: RolloutBatch, routing: RoutingUse, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` inside `routed_forward` with the batch's recorded experts laid out as the forward
    flattens its tokens: packed, the real tokens row after row; padded, the ``[b, W]`` columns the forward
    keeps (`TRIM_PADDING`), row-major. Rows are packed whole (a shared prompt would need one routing for
    several rows). The response tokens are the ones measured."""
    if kwargs["sp_group"] is not None:
        raise NotImplementedError("routing replay with Ulysses sequence parallelism")
    _, attention_mask, _ = batch.sequences()  # [b, Tp+Tr]
    prompt_len = batch.prompts.shape[1]
    response = torch.zeros_like(attention_mask, dtype=torch.bool)  # [b, Tp+Tr]
    response[:, prompt_len:] = batch.response_mask.bool()
    recorded = batch.routed_experts  # [b, Tp+Tr, L, k]
    if kwargs["remove_padding"]:
        keep = attention_mask.bool()  # the tokens `pack_batch` keeps, in its order
        ids, counted = recorded[keep], response[keep]  # [N, L, k], [N]
    else:
        first, last = kept_columns(batch)  # the columns `response_log_probs` keeps
        cols = slice(first, prompt_len + last)
        ids, counted = recorded[:, cols].flatten(0, 1), response[:, cols].flatten()  # [b*W, L, k], [b*W]
    with routed_forward(model, ids, counted, routing):
        return response_log_probs(model, batch, share_prompts=False, **kwargs)


@torch.no_grad()
def batched_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    micro_batch_size: int,
    max_token_len: int | None = None,
    remove_padding: bool = False,
    sp_group: Any = None,
    share_prompts: bool = False,
    routing: RoutingUse | None = None,
) -> torch.Tensor:
    """No-grad log-probs of the whole batch, ``[B, Tr]``: ``micro_batch_size`` rows per forward, or
    micro-batches of at most ``max_token_len`` real tokens when that is set (dynamic batch size).
    ``sp_group``: Ulysses sequence parallelism (see `response_log_probs`)."""
    return batched_log_probs_and_sum_pi_squared(
        model,
        batch,
        temperature=temperature,
        micro_batch_size=micro_batch_size,
        max_token_len=max_token_len,
        remove_padding=remove_padding,
        with_sum_pi_squared=False,
        sp_group=sp_group,
        share_prompts=share_prompts,
        routing=routing,
    )[0]


@torch.no_grad()
def batched_log_probs_and_sum_pi_squared(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    micro_batch_size: int,
    max_token_len: int | None = None,
    remove_padding: bool = False,
    with_sum_pi_squared: bool = True,
    sp_group: Any = None,
    share_prompts: bool = False,
    routing: RoutingUse | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`batched_log_probs` and, from the same forwards, Σπ² ``[B, Tr]`` (None unless
    ``with_sum_pi_squared``); both 0 on padding."""
    mbs, order = split_micro_batches(
        batch, rows=micro_batch_size, max_token_len=max_token_len, share_prompts=share_prompts
    )
    with gathered_for_pass(model):  # one all-gather per layer for the whole pass, not per micro-batch
        outs = [
            response_log_probs(
                model,
                mb,
                temperature=temperature,
                remove_padding=remove_padding,
                with_sum_pi_squared=with_sum_pi_squared,
                sp_group=sp_group,
                share_prompts=share_prompts,
                routing=routing,
            )
            for mb in mbs
        ]  # ([b_i, Tr], [b_i, Tr] | None) each
    mask = batch.response_mask
    log_probs = restore_order([o[0] for o in outs], order) * mask  # [B, Tr], 0 on padding
    if not with_sum_pi_squared:
        return log_probs, None
    spp = restore_order([o[1] for o in outs if o[1] is not None], order)  # [B, Tr]
    return log_probs, torch.where(mask != 0, spp, torch.zeros_like(spp))  # [B, Tr], 0 on padding
