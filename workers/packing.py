"""Remove-padding ("sequence packing") for the training forward.

A padded micro-batch of ``b`` rows runs ``b x (Tp+Tr)`` token positions through the model, however short
the real sequences are. Packed, the real prompt+response tokens of every row are laid end to end in one
row ``[1, N]`` (``N`` = real tokens of the micro-batch) with ``position_ids`` restarting at 0 for every
sequence and no attention mask. Transformers reads the restarts of ``position_ids`` as sequence
boundaries: for SDPA / eager it builds a block-diagonal causal mask (``find_packed_sequence_indices`` in
``transformers.masking_utils``), and flash-attention 2 runs its variable-length kernels on the same
boundaries; fusedrl's CPU attention (`fusedrl.workers.cpu_attention`) attends each sequence on its own
and has Transformers build no mask (`fusedrl.workers.cpu_attention.one_row_mask`), for every decoder
architecture alike. Each token therefore sees exactly the tokens it sees in the padded forward, at the same
positions, so the outputs agree with the padded path up to floating-point summation order.

The model's per-token outputs (logits, values) come back as ``[1, N, ...]``; `PackedBatch.response_rows`
picks, for every real response token, the output at the position that predicts it (the token just
before it), and `PackedBatch.unpack` scatters per-token results back into the ``[b, Tr]`` layout of the
batch, zero on padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fusedrl.batch import RolloutBatch


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """One micro-batch with its padding removed.

    input_ids:     [1, N] int64, the real tokens of every row, rows end to end (row order kept).
    position_ids:  [1, N] int64, 0, 1, ... within each row's sequence; the restarts mark the boundaries.
    pred_index:    [M] int64, for each real response token (row-major over ``[b, Tr]``), the index into
                   ``N`` of the position whose output predicts it.
    targets:       [M] int64, those response token ids.
    response_mask: [b, Tr] bool, where the ``M`` response tokens sit in the padded layout.
    model_kwargs:  extra keywords of the model's forward: for a compiled model, the row's
                   `fusedrl.workers.cpu_attention.segment_layout` (see `pack_batch`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pred_index: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def forward(self, model: torch.nn.Module) -> Any:
        """The model's forward on the packed row (no attention mask: the position restarts are the mask)."""
        return model(
            input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None, **self.model_kwargs
        )

    def response_logits(self, model: torch.nn.Module) -> torch.Tensor:
        """A causal LM's logits ``[M, V]`` at the positions that predict the response tokens: the LM head
        runs on those positions only (``logits_to_keep``)."""
        out = model(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=None,
            logits_to_keep=self.pred_index,
            **self.model_kwargs,
        )
        return out.logits[0]  # [M, V]

    def response_rows(self, output: torch.Tensor) -> torch.Tensor:
        """``[1, N, *F]`` model output -> ``[M, *F]``: the output that predicts each response token."""
        return output[0, self.pred_index]  # [M, *F]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[M]`` per-response-token values -> ``[b, Tr]``, 0 on padding (differentiable)."""
        out = values.new_zeros(self.response_mask.shape)  # [b, Tr]
        return out.masked_scatter(self.response_mask, values)  # [b, Tr]


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether ``model``'s packed rows may hold a prompt once for the rows that share it
    (`pack_shared_prompts`): only fusedrl's CPU attention reads the shared layout, and it runs such a row
    with any sliding window or logit cap, but not with attention dropout (a model with some gets whole
    rows)."""
    from fusedrl.workers.cpu_attention import NAME

    config = getattr(model, "config", None)
    return (
        config is not None
        and getattr(config, "_attn_implementation", None) == NAME
        and not float(getattr(config, "attention_dropout", 0.0) or 0.0)
    )


def pack_batch(batch: RolloutBatch, *, layout: bool = False, share_prompts: bool = False) -> PackedBatch:
    """Pack the real prompt+response tokens of ``batch``'s rows into one row (see the module docstring).

    Tokens are kept where ``batch.sequences()``'s attention mask is 1 and keep the positions that
    method gives them, so the packed forward sees exactly what the padded forward attends to.

    ``layout`` (a model with compiled layers, `fusedrl.workers.layer_compile`): the row carries its
    `segment_layout` for fusedrl's attention, tensors whose sizes a compiled layer takes as symbolic,
    instead of sequence boundaries read from the positions as Python numbers.

    ``share_prompts``: rows with the same prompt (a GRPO group's samples) share one copy of it in the row
    (`pack_shared_prompts`); the model must run fusedrl's CPU attention (`can_share_prompts`).
    """
    if share_prompts:
        return pack_shared_prompts(batch, one_call=layout)
    input_ids, attention_mask, position_ids = batch.sequences()  # [b, Tp+Tr] each
    keep = attention_mask.bool()  # [b, Tp+Tr]
    # Index of every kept token in the packed row (meaningless where keep is False).
    flat_index = keep.flatten().cumsum(0).view(keep.shape) - 1  # [b, Tp+Tr]
    prompt_len = batch.prompts.shape[1]
    response_mask = batch.response_mask.bool()  # [b, Tr]
    # The response token at packed index k is predicted by the output at k - 1: the previous real token
    # of the same sequence (the last prompt token for the first response token).
    pred_index = flat_index[:, prompt_len:][response_mask] - 1  # [M]
    ids, pos = input_ids[keep].unsqueeze(0), position_ids[keep].unsqueeze(0)  # [1, N] each
    model_kwargs: dict[str, Any] = {}
    if layout:
        from fusedrl.workers.cpu_attention import LAYOUT_KWARG, segment_layout

        model_kwargs[LAYOUT_KWARG] = segment_layout(keep.sum(1).tolist(), device=ids.device)
    return PackedBatch(
        input_ids=ids,  # [1, N]
        position_ids=pos,  # [1, N]
        pred_index=pred_index.clamp(min=0),  # [M]; >= 0 whenever every row has a prompt token
        targets=batch.responses[response_mask],  # [M]
        response_mask=response_mask,  # [b, Tr]
        model_kwargs=model_kwargs,
    )


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """The rows of ``batch`` grouped by identical real prompt tokens, groups in order of first appearance
    (a GRPO group's samples, wherever balancing put them in the micro-batch)."""
    groups: dict[bytes, list[int]] = {}
    keep = batch.prompt_mask.bool()  # [b, Tp]
    for row in range(batch.num_samples):
        groups.setdefault(batch.prompts[row][keep[row]].numpy().tobytes(), []).append(row)
    return list(groups.values())


def pack_shared_prompts(batch: RolloutBatch, *, one_call: bool = False) -> PackedBatch:
    """`pack_batch` with each distinct prompt once: the row holds, per group of rows with the same prompt,
    the prompt's tokens followed by every row's response-side tokens (positions as in the padded forward:
    each response continues at the prompt's length). The attention gets a `shared_prompt_layout` that
    lays out every sample's whole sequence (the shared prompt, then its own response) as one row of a
    padded batch, so each response token sees exactly the keys it sees unshared. Per-token work (the
    linears, norms, MLPs) runs on the prompt once per group instead of once per sample: with GRPO's n
    samples of ``P`` prompt and ``R`` response tokens, ``P + nR`` tokens instead of ``n(P + R)``. Same
    outputs as `pack_batch` up to floating-point summation order (the prompt's gradients arrive summed
    over its samples). ``one_call``: every sample in one padded attention call (a compiled layer's graph
    then keeps one structure), else samples of very different lengths go in separate calls
    (`attention_buckets`)."""
    from fusedrl.workers.cpu_attention import SHARED_LAYOUT_KWARG

    input_ids, attention_mask, position_ids = batch.sequences()  # [b, T] each, T = Tp + Tr
    b, total_cols = input_ids.shape
    prompt_len = batch.prompts.shape[1]
    keep = attention_mask.bool()  # [b, T]
    # Whole-tensor indexing, not a loop over rows: the same indices without ~10 small ops per row (with
    # the bucket search, ~6 of a 32-row pack's ~9 ms were per-op overhead; a step packs three times).
    leader = torch.empty(b, dtype=torch.long)  # each row's group's first row, whose prompt it shares
    slot = torch.empty(b, dtype=torch.long)  # the row's place in its group: its response's order
    group_of = torch.empty(b, dtype=torch.long)
    for g, group in enumerate(prompt_groups(batch)):
        rows = torch.tensor(group)
        leader[rows], slot[rows], group_of[rows] = group[0], torch.arange(len(group)), g
    is_prompt = torch.arange(total_cols) < prompt_len  # [T]
    # The packed row holds, per group, its first row's kept prompt tokens, then each row's kept response.
    held = keep & (~is_prompt[None, :] | (leader == torch.arange(b))[:, None])  # [b, T]
    # Order of the held (row, col): group, then its prompt (0) before its rows' responses (1 + slot), then col.
    part = torch.where(is_prompt[None, :], 0, 1 + slot[:, None])  # [b, T]
    key = (group_of[:, None] * (b + 1) + part) * total_cols + torch.arange(total_cols)[None, :]  # [b, T]
    flat = torch.nonzero(held.flatten()).flatten()  # held cells, row-major
    flat = flat[torch.argsort(key.flatten()[flat])]  # [N], the packed row's order (the keys are distinct)
    new_index = torch.zeros(b, total_cols, dtype=torch.long)  # packed index of each kept (row, col)
    new_index.view(-1)[flat] = torch.arange(flat.numel())
    new_index[:, :prompt_len] = new_index[leader, :prompt_len]  # a row's prompt tokens are its leader's
    out_row = flat // total_cols  # [N]: the sample whose attention output each packed token takes
    # Each sample's whole sequence: its leader's kept prompt columns, then its own kept response columns.
    in_sequence = torch.cat([keep[leader, :prompt_len], keep[:, prompt_len:]], dim=1)  # [b, T]
    sequences = list(torch.split(new_index[in_sequence], in_sequence.sum(1).tolist()))  # b x [L_s]
    ids, pos = input_ids.flatten()[flat][None], position_ids.flatten()[flat][None]  # [1, N] each
    # The token at (row, col) is predicted by the output at the row's previous kept token.
    previous = torch.zeros(b, total_cols, dtype=torch.long)  # [b, T]
    kept_rows, kept_cols = torch.nonzero(keep, as_tuple=True)  # row-major: a row's kept columns ascending
    same = kept_rows[1:] == kept_rows[:-1]
    previous[kept_rows[1:][same], kept_cols[1:][same]] = new_index[kept_rows[:-1][same], kept_cols[:-1][same]]
    response_mask = batch.response_mask.bool()  # [b, Tr]
    pred_index = previous[:, prompt_len:][response_mask]  # [M]
    layout = shared_prompt_layout(sequences, out_row, one_call=one_call)
    return PackedBatch(
        input_ids=ids,  # [1, N]
        position_ids=pos,  # [1, N]
        pred_index=pred_index,  # [M]
        targets=batch.responses[response_mask],  # [M]
        response_mask=response_mask,  # [b, Tr]
        model_kwargs={SHARED_LAYOUT_KWARG: layout},
    )


# What one more padded attention call costs, in (query, key) pairs of attention work: about the fixed cost
# of a call's gathers, kernel and backward (~0.2 ms on CPU) against the work of a pair on a small model.
CALL_COST = 64 * 64


def attention_buckets(lengths: list[int], *, call_cost: int = CALL_COST) -> list[list[int]]:
    """The samples (indices into ``lengths``) split into padded attention calls, shortest first: each call
    pads its samples to its longest, costing ``samples x longest^2`` pairs plus ``call_cost``; the split
    minimises the sum (contiguous runs of the samples sorted by length, found exactly). Samples of similar
    lengths share one call; a long tail (one sample of 512 tokens among samples of 60) gets its own
    instead of padding every sample to 512."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    # Plain Python floats (float64), not tensors: the search is O(S^2) scalar steps, and as tensor ops its
    # per-op overhead was most of a 32-sample pack (~5 ms of ~9). The same sums in the same order, and the
    # first of equal costs wins as with ``argmin``, so the split is the one the tensor version found.
    squares = [float(lengths[i]) ** 2 for i in order]  # [S], ascending
    best = [0.0] * (len(order) + 1)  # best[j]: the cheapest split of the j shortest
    start = [0] * (len(order) + 1)  # start[j]: where the last call of that split begins
    for j in range(1, len(order) + 1):
        last_sq = squares[j - 1]
        costs = [best[i] + float(j - i) * last_sq + call_cost for i in range(j)]  # the last call: i..j-1
        start[j] = min(range(j), key=costs.__getitem__)
        best[j] = costs[start[j]]
    calls, end = [], len(order)
    while end:
        calls.append(order[start[end] : end])
        end = start[end]
    return calls[::-1]


def shared_prompt_layout(
    sequences: list[torch.Tensor], out_row: torch.Tensor, *, one_call: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """The attention calls of a shared-prompt row for
    `fusedrl.workers.cpu_attention.shared_segments_attention`: one ``(src [S, L], dst [n], tokens [n])``
    per call (`attention_buckets`; ``one_call``: one call for every sample).

    ``sequences[s]``: the packed indices of sample ``s``'s whole sequence in order (its prompt's tokens,
    shared with its group, then its own); ``out_row [N]``: for each packed token, the sample whose
    attention output it takes (for a prompt token, the first sample of its group). In a call of samples
    ``s_0, s_1, ...``, ``src[i, c]`` is the packed token at column ``c`` of sample ``s_i``'s row (padding
    slots repeat a real token: the causal mask keeps real queries off them); ``tokens`` are the packed
    tokens that read their output from this call, ``dst`` the flat ``i * L + c`` slot each reads."""
    lengths = [int(seq.numel()) for seq in sequences]
    every = torch.cat(sequences) if sequences else torch.zeros(0, dtype=torch.long)  # all samples' tokens
    sizes = torch.tensor(lengths, dtype=torch.long)  # [S]
    starts = torch.cumsum(sizes, 0) - sizes  # [S]: where each sample's tokens begin in ``every``
    owner = torch.repeat_interleave(torch.arange(len(sequences)), sizes)  # [sum L]: their sample
    at = torch.arange(every.numel()) - starts[owner]  # [sum L]: their column in the sample's row
    mine = out_row[every] == owner  # the entries whose token reads its output from this sample
    column = torch.zeros(out_row.numel(), dtype=torch.long)  # [N]: each token's column in its output row
    column[every[mine]] = at[mine]  # a token is its output sample's once: no two writes to one slot
    calls = [list(range(len(sequences)))] if one_call else attention_buckets(lengths)
    layout = []
    for samples in calls:
        longest = max(max(lengths[s] for s in samples), 1)
        chosen = torch.tensor(samples, dtype=torch.long)  # [S_call]
        n = sizes[chosen][:, None]  # [S_call, 1]
        # Column c of a sample's row: its token c, or past its end its last token (padding); none: 0.
        c = torch.minimum(torch.arange(longest)[None, :], (n - 1).clamp(min=0))  # [S_call, L]
        picks = (starts[chosen][:, None] + c).clamp(max=max(every.numel() - 1, 0))  # [S_call, L]
        src = torch.where(n > 0, every[picks], 0) if every.numel() else torch.zeros_like(c)  # [S_call, L]
        local = torch.full((len(sequences),), -1, dtype=torch.long)  # sample -> its row in this call
        local[chosen] = torch.arange(len(samples))
        tokens = torch.nonzero(local[out_row] >= 0).flatten()  # [n], ascending
        layout.append((src, local[out_row[tokens]] * longest + column[tokens], tokens))
    return tuple(layout)
