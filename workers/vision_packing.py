"""Packed rows ("remove padding") for a vision-language policy's log-prob passes.

The text path's packing (`fusedrl.workers.packing`) lays the real tokens of every row end to end in one row
with positions restarting at 0 per sequence. A Qwen2-VL / Qwen2.5-VL decoder needs two kinds of position for
that: its M-RoPE positions (temporal, height, width; the rotary embedding reads them) and plain text positions
(0, 1, ... per sequence; transformers builds the block-diagonal causal mask from their restarts). transformers
takes both as one ``position_ids`` tensor ``[4, 1, N]``: row 0 the text positions, rows 1-3 the M-RoPE ones
(``Qwen2_5_VLTextModel.forward``). The M-RoPE positions are computed on the padded layout by the model's own
``get_rope_index`` (`fusedrl.workers.vision.mrope_positions`) and then packed with the tokens, so every token
keeps the position it has in the padded forward, and so in the engine's.

The images are unchanged by packing: the rows' patches are concatenated in row order, the order in which their
image tokens appear in the packed row, so the model scatters each image's features into its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PackedVisionRow:
    """One micro-batch's real tokens in one row.

    input_ids:    [1, N] the real tokens of every row, end to end (row order kept).
    position_ids: [4, 1, N] text positions (row 0) and M-RoPE positions (rows 1-3) of those tokens.
    pred_index:   [M] for each real response token (row-major over ``[B, Tr]``), the index into ``N`` of the
                  position that predicts it (the token just before it in its own sequence).
    response_mask: [B, Tr] bool, where the ``M`` response tokens sit in the padded layout.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pred_index: torch.Tensor
    response_mask: torch.Tensor

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[M]`` per-response-token values -> ``[B, Tr]``, 0 elsewhere (differentiable)."""
        return values.new_zeros(self.response_mask.shape).masked_scatter(self.response_mask, values)


def pack_vision_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mrope: torch.Tensor,
    response_mask: torch.Tensor,
) -> PackedVisionRow:
    """Pack ``input_ids`` / ``attention_mask`` [B, Tp+Tr] (left-padded prompts, right-padded responses) and
    their M-RoPE positions ``mrope`` [3, B, Tp+Tr]; ``response_mask`` [B, Tr] marks the response tokens."""
    keep = attention_mask.bool()  # [B, T]
    text = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, T]: 0, 1, ... over each row's real tokens
    flat_index = keep.flatten().cumsum(0).view(keep.shape) - 1  # [B, T]: index in the packed row
    tp = input_ids.shape[1] - response_mask.shape[1]
    resp = response_mask.bool()  # [B, Tr]
    pred_index = (flat_index[:, tp:][resp] - 1).clamp(min=0)  # [M]
    positions = torch.cat([text[keep].unsqueeze(0), mrope[:, keep]], dim=0)  # [4, N]
    return PackedVisionRow(
        input_ids=input_ids[keep].unsqueeze(0),  # [1, N]
        position_ids=positions.unsqueeze(1),  # [4, 1, N]
        pred_index=pred_index,  # [M]
        response_mask=resp,  # [B, Tr]
    )
