"""Remove-padding ("sequence packing") for the training forward.

A padded micro-batch of ``b`` rows runs ``b x (Tp+Tr)`` token positions through the model, however short
the real sequences are. Packed, the real prompt+response tokens of every row are laid end to end in one
row ``[1, N]`` (``N`` = real tokens of the micro-batch) with ``position_ids`` restarting at 0 for every
sequence and no attention mask. Transformers reads the restarts of ``position_ids`` as sequence
boundaries: for SDPA / eager it builds a block-diagonal causal mask (``find_packed_sequence_indices`` in
``transformers.masking_utils``), and flash-attention 2 runs its variable-length kernels on the same
boundaries. Each token therefore sees exactly the tokens it sees in the padded forward, at the same
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
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=packed_mask_argument(model),
            **self.model_kwargs,
        )

    def response_logits(self, model: torch.nn.Module) -> torch.Tensor:
        """A causal LM's logits ``[M, V]`` at the positions that predict the response tokens: the LM head
        runs on those positions only (``logits_to_keep``)."""
        out = model(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=packed_mask_argument(model),
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


def packed_mask_argument(model: torch.nn.Module) -> dict[str, None] | None:
    """The ``attention_mask`` a packed forward passes: None, from which Transformers builds the row's
    block-diagonal causal mask from the position restarts, or, when fusedrl's CPU attention runs every
    layer (`fusedrl.workers.cpu_attention`: it finds the sequences from the positions or the carried
    layout and never reads a mask), a ready mapping of no mask per layer type, which skips building one
    (a ``[N, N]`` boolean mask: 10-25 ms a forward on a 4k-token row, ~1.5% of a GRPO step). A model with
    sliding-window layers keeps the mask: those layers take SDPA with it."""
    from fusedrl.workers.cpu_attention import NAME

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != NAME:
        return None
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if set(layer_types) != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return None
    return {"full_attention": None}


def pack_batch(batch: RolloutBatch, *, bucketed: bool = False) -> PackedBatch:
    """Pack the real prompt+response tokens of ``batch``'s rows into one row (see the module docstring).

    Tokens are kept where ``batch.sequences()``'s attention mask is 1 and keep the positions that
    method gives them, so the packed forward sees exactly what the padded forward attends to.

    ``bucketed`` (a model with compiled layers, `fusedrl.workers.layer_compile`): the row is widened with
    filler tokens to a `bucket_width` and carries its `segment_layout` (longest sequence also widened to a
    bucket) for the attention, so a compiled layer sees a few shapes per run instead of one per
    micro-batch. The filler sits after every real token, attends only to itself and is never read.
    """
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
    if bucketed:
        from fusedrl.workers.cpu_attention import LAYOUT_KWARG, segment_layout
        from fusedrl.workers.layer_compile import bucket_width

        lengths = keep.sum(1).tolist()  # real tokens per row
        total, longest = bucket_width(ids.shape[1]), bucket_width(max(max(lengths), 1))
        filler = total - ids.shape[1]
        if filler:
            ids = torch.cat([ids, ids.new_zeros(1, filler)], dim=1)  # [1, total]
            pos = torch.cat([pos, (torch.arange(filler, device=pos.device) % longest)[None]], dim=1)
        model_kwargs[LAYOUT_KWARG] = segment_layout(lengths, total=total, longest=longest, device=ids.device)
    return PackedBatch(
        input_ids=ids,  # [1, N] (bucketed: [1, total])
        position_ids=pos,  # [1, N] (bucketed: [1, total])
        pred_index=pred_index.clamp(min=0),  # [M]; >= 0 whenever every row has a prompt token
        targets=batch.responses[response_mask],  # [M]
        response_mask=response_mask,  # [b, Tr]
        model_kwargs=model_kwargs,
    )
