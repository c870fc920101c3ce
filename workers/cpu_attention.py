"""Attention of the training forwards on CPU: PyTorch SDPA, except short half-precision sequences and
packed rows.

PyTorch's CPU flash-attention kernel (what SDPA picks on CPU) is slow on short bf16 sequences: forward
plus backward of ``32 x 8 heads x 128 tokens`` takes 2-3x as long as a plain ``softmax(q k^T) v`` made of
two batched matmuls, and its backward was a fifth of a bf16 actor update's time on RL-sized batches
(responses of a few hundred tokens). From about 256 keys on the flash kernel wins and keeps memory
linear in length, and in float32 it wins at every length (benchmarks/RESULTS.md, "Attention kernels on
CPU"). So `attention` runs the two matmuls when all of these hold, and SDPA otherwise:

- the tensors are on CPU and in bf16 or fp16;
- there are fewer than `MATMUL_BELOW` keys;
- there is no attention dropout.

A packed row (``use_remove_padding``: several sequences end to end, positions restarting) gets each
sequence's causal attention on its own (`packed_attention`) instead of SDPA over the whole row with a
block-diagonal mask, whose masked blocks PyTorch's CPU kernels still compute.

The matmul path computes the scores in the input dtype, the softmax in float32 (as Hugging Face's eager
attention does), and gives fully masked query rows (left padding) a finite uniform softmax instead of NaN.
It saves the ``[b, heads, q, k]`` probabilities for backward (flash saves none), bounded by the length
limit. The choice depends only on shapes and dtypes, so a recomputation under gradient checkpointing
takes the same path as the forward it replays.

`register` makes the function and its mask builder (SDPA's boolean masks) known to Transformers under
`NAME`; ``model.attn_implementation=auto`` selects it on CPU (`fusedrl.workers.fsdp.resolve_attn_implementation`).
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "fusedrl_cpu_sdpa"
MATMUL_BELOW = 256  # keys; measured crossover of the bf16 kernels on CPU (see the module docstring)


def takes_matmul_path(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    """Whether `attention` runs the two matmuls for these inputs (see the module docstring)."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and key.shape[-2] < MATMUL_BELOW
        and dropout == 0.0
    )


def matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float,
    causal: bool,
) -> torch.Tensor:
    """``softmax(q k^T * scaling + mask) v`` with grouped-query heads, softmax in float32.

    query: [b, h, q, d]; key, value: [b, kvh, k, d] with kvh dividing h; mask: [b | 1, 1, q, k], boolean
    (True attends) or additive, or None (then causal, aligned to the last key, when ``causal``).
    Returns [b, h, q, d].
    """
    b, h, q_len, d = query.shape
    kvh, k_len = key.shape[1], key.shape[2]
    group = h // kvh
    q5 = query.view(b, kvh, group, q_len, d)  # the heads sharing one key/value head side by side
    scores = torch.matmul(q5, key.unsqueeze(2).transpose(-1, -2)).float() * scaling  # [b, kvh, g, q, k]
    if mask is None and causal and q_len > 1:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if mask is not None:
        mask = mask.unsqueeze(-3) if mask.dim() == 4 else mask  # [b|1, 1, 1, q, k] against the group dim
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [b, kvh, g, q, k]
    out = torch.matmul(probs, value.unsqueeze(2))  # [b, kvh, g, q, d]
    return out.reshape(b, h, q_len, d)


def packed_segments(position_ids: Any, query: torch.Tensor, key: torch.Tensor) -> list[int] | None:
    """Start offsets of the sequences of a packed row (``use_remove_padding``), plus its length at the
    end, or None when the input is not a packed row of several sequences on CPU.

    A new sequence starts wherever a position is not its predecessor's + 1, the rule Transformers uses to
    build its block-diagonal mask for packed rows (fusedrl's packing restarts positions at 0)."""
    if not (
        isinstance(position_ids, torch.Tensor)
        and query.device.type == "cpu"
        and query.shape[0] == 1
        and position_ids.shape == (1, query.shape[2])
        and key.shape[2] == query.shape[2]  # no KV cache: every key is one of this row's tokens
    ):
        return None
    pos = position_ids[0]  # [N]
    starts = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    if not starts:
        return None
    return [0, *starts, int(pos.numel())]


def packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], *, scaling: float
) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: ``[1, h, N, d]`` query, ``[1, kvh, N, d]``
    key/value -> ``[1, h, N, d]``.

    Transformers gives SDPA a block-diagonal ``[N, N]`` mask for a packed row, and PyTorch's CPU kernels
    compute every block of it, masked or not: attention costs ``N^2`` instead of the sum of the sequences'
    squares (32 sequences of 100 tokens: 32x the work). Here, when every sequence is shorter than
    `MATMUL_BELOW`, the sequences are laid out as the rows of one padded batch (one kernel call instead of
    one per sequence: the calls' fixed cost dominates at these lengths) with the kernel an unpacked batch
    would get; longer sequences get their own causal attention one at a time."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if max(lengths) < MATMUL_BELOW:
        return segments_attention(query, key, value, segment_layout(lengths), scaling=scaling)
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        outs.append(_causal_attention(q, k, v, None, scaling=scaling))
    return torch.cat(outs, dim=2)  # [1, h, N, d]


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scaling: float
) -> torch.Tensor:
    """Causal attention (``mask``: None, or a boolean mask that already holds the causal pattern) by the
    kernel an unpacked batch of these shapes gets: `matmul_attention` or SDPA."""
    if takes_matmul_path(q, k, 0.0):
        return matmul_attention(q, k, v, mask, scaling=scaling, causal=True)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )


# The keyword a packed forward of a compiled model passes its `segment_layout` under: Transformers hands
# the model's extra keywords down to every attention call.
LAYOUT_KWARG = "fusedrl_segments"


def segment_layout(
    lengths: list[int], *, total: int | None = None, longest: int | None = None, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token of a packed row goes in a right-padded ``[S, L]`` batch of its sequences:
    ``(row [N], col [N], mask [S, 1, L, L])``, the mask causal over each row's real keys.

    ``lengths``: the sequences' lengths in row order. ``total`` > sum(lengths): the row ends in that many
    filler tokens (a compiled model's packed row, widened to a few sizes), which go to one extra row at
    columns clamped to ``L - 1``; they attend among themselves only and nothing attends to them.
    ``longest`` >= max(lengths) widens ``L`` (again for a few sizes); the added keys are masked."""
    real_total = sum(lengths)
    total = real_total if total is None else total
    filler = total - real_total
    longest = max(lengths) if longest is None else longest
    counts = list(lengths) + ([filler] if filler > 0 else [])
    s_count = len(counts)
    starts = torch.tensor([0, *counts[:-1]], device=device).cumsum(0)  # [S]
    sizes = torch.tensor(counts, device=device)  # [S]
    row = torch.repeat_interleave(torch.arange(s_count, device=device), sizes)  # [N]
    col = (torch.arange(total, device=device) - starts[row]).clamp(max=longest - 1)  # [N]
    pos = torch.arange(longest, device=device)
    real = pos[None] < sizes[:, None]  # [S, L] keys that exist
    mask = (pos[None, :, None] >= pos[None, None, :]) & real[:, None, :]  # [S, L, L] causal, real keys
    return row, col, mask[:, None]  # [N], [N], [S, 1, L, L]


def segments_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    scaling: float,
) -> torch.Tensor:
    """`packed_attention` through a `segment_layout`: scatter the row's tokens into a right-padded
    ``[S, heads, L, d]`` batch, attend with the layout's mask, gather the tokens back (all differentiable;
    shapes depend only on the layout's, so a compiled layer sees one shape per layout size)."""
    row, col, mask = layout
    s_count, longest = mask.shape[0], mask.shape[-1]

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, N, d] -> [S, H, L, d]
        rows = x.new_zeros(s_count, longest, x.shape[1], x.shape[3])
        rows[row, col] = x[0].transpose(0, 1)  # [N, H, d] into their (sequence, position) slots
        return rows.transpose(1, 2)

    q, k, v = to_rows(query), to_rows(key), to_rows(value)
    out = _causal_attention(q, k, v, mask, scaling=scaling)  # [S, h, L, d]
    return out.transpose(1, 2)[row, col].transpose(0, 1)[None]  # [1, h, N, d]


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A Transformers attention function (``[b, h, q, d]`` inputs, ``[b, q, h, d]`` output)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and not kwargs.get("output_attentions")
    )
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # A sliding window lives in Transformers' mask only: a packed row with one goes to SDPA with that mask.
    packable = plain and causal and dropout == 0.0 and kwargs.get("sliding_window") is None
    layout = kwargs.get(LAYOUT_KWARG)
    if packable and layout is not None and query.shape[0] == 1 and query.shape[2] == layout[0].shape[0]:
        return segments_attention(query, key, value, layout, scaling=scale).transpose(1, 2).contiguous(), None
    bounds = packed_segments(kwargs.get("position_ids"), query, key) if packable else None
    if bounds is not None:
        return packed_attention(query, key, value, bounds, scaling=scale).transpose(1, 2).contiguous(), None
    if not (plain and takes_matmul_path(query, key, dropout)):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = matmul_attention(
        query,
        key,
        value,
        attention_mask,
        scaling=scale,
        causal=causal,
    )  # [b, h, q, d]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `attention` (with SDPA's mask builder) available as ``attn_implementation=NAME``; returns
    `NAME`. Idempotent: every process that loads a model calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
