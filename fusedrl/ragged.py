"""A padded ``[B, T]`` token field and its mask as one tensor (issue 39 item 3: fewer tensor crossings).

A left-padded prompt (``prompts`` / ``prompt_mask``) or a right-padded single-turn response (``responses`` /
``response_mask``) is two ``[B, T]`` tensors whose information is each row's tokens and its length: the mask
is ones over exactly those tokens and the padding is one pad id. `pack` puts that in ONE 1-D tensor, each
row's length followed by the rows' tokens one after another (``[B + sum(lengths)]``, the token dtype), with
the width, the pad id, the side and the mask's dtype as plain values; `RaggedRows.unpack` rebuilds both
tensors bit for bit. A field that does not have that form (a mask with holes: multi-turn observation
tokens; padding that is not one id) is not packed: `pack` answers None and the caller sends the padded
tensors as before.

Why not ``torch.nested``'s jagged layout: it pickles through Ray, but it is still two tensors inside (values
and offsets), its first use imports ``torch._dynamo`` (1.6 s measured here, in every process) and prints a
``torch.fx`` deprecation warning; the packed tensor is plain and its bytes (lengths + tokens) are what
`fusedrl.controller.worker_group.TensorTraffic` counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RaggedRows:
    """Rows of a ``[rows, width]`` token field and its 0/1 mask (`pack`).

    ``packed``: ``[rows + sum(lengths)]``, the lengths then the tokens, in the field's dtype; ``left``: the
    padding is on the left (prompts) rather than the right (responses); ``pad``: the padding's id;
    ``mask_dtype``: the mask's dtype; ``mask``: the mask field's name (``unpack`` gives it back under it)."""

    packed: torch.Tensor
    rows: int
    width: int
    pad: int
    left: bool
    mask_dtype: torch.dtype
    mask: str

    @property
    def lengths(self) -> torch.Tensor:
        """``[rows]`` each row's number of tokens."""
        return self.packed[: self.rows]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded field ``[rows, width]`` and its mask, equal to what `pack` was given."""
        lengths = self.lengths.long()
        real = _real_positions(lengths, self.width, self.left)  # [rows, width] bool
        values = torch.full((self.rows, self.width), self.pad, dtype=self.packed.dtype)
        values.masked_scatter_(real, self.packed[self.rows :])  # row-major, as `pack` read them
        return values, real.to(self.mask_dtype)


def _real_positions(lengths: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    """``[B, width]`` bool: True on each row's ``lengths[b]`` last (``left``) or first positions."""
    positions = torch.arange(width).unsqueeze(0)  # [1, width]
    if left:
        return positions >= (width - lengths).unsqueeze(1)
    return positions < lengths.unsqueeze(1)


def pack(values: torch.Tensor, mask: torch.Tensor, *, left: bool, mask_name: str) -> RaggedRows | None:
    """``values`` ``[B, T]`` (integer ids) and its 0/1 ``mask`` as one `RaggedRows`; None unless exact: each
    row's mask is ones on a contiguous run at the padded side's far end (the right end of a left-padded row,
    the start of a right-padded one) and every padding position holds the same id."""
    if values.dim() != 2 or mask.shape != values.shape:
        raise ValueError(
            f"pack: values {tuple(values.shape)} and mask {tuple(mask.shape)} must be one [B, T]"
        )
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"pack: token ids are integers, got {values.dtype}")
    values, mask = values.cpu(), mask.cpu()
    rows, width = values.shape
    if width > torch.iinfo(values.dtype).max:
        return None  # the lengths would not fit the tokens' dtype
    lengths = mask.sum(dim=1)  # [B]; a mask that is not 0 / 1 fails the comparison below
    real = _real_positions(lengths, width, left)
    if not torch.equal(mask, real.to(mask.dtype)):
        return None  # holes in the mask, or values other than 0 / 1
    short = (lengths < width).nonzero()  # rows with padding: the first one's padding id is the pad
    pad = 0 if short.numel() == 0 else int(values[int(short[0, 0]), 0 if left else width - 1])
    if not torch.equal(values.masked_fill(real, pad), torch.full_like(values, pad)):
        return None  # more than one id in the padding
    packed = torch.cat([lengths.to(values.dtype), torch.masked_select(values, real)])  # [B + sum(lengths)]
    return RaggedRows(packed, rows, width, pad, left, mask.dtype, mask_name)
