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
block-diagonal mask, whose masked blocks PyTorch's CPU kernels still compute. A sliding-window layer
(Mistral, Qwen2's windowed layers, Gemma 2/3's local layers) limits each sequence's mask to its window
(`_window_mask`, ``[L, L]`` per sequence instead of the row's ``[N, N]``), so no packed row needs
Transformers' mask: `one_row_mask` builds none for a one-row forward without padding or cache (it also
spares a ``[N, N]`` boolean mask per forward: 10-25 ms on a 4k-token row, ~1.5% of a GRPO step).

Logit soft-capping (Gemma 2's ``attn_logit_softcapping``: ``softcap * tanh(scores / softcap)`` before the
mask) is not in PyTorch's SDPA, which Transformers' ``sdpa`` runs without it; a layer with a cap takes the
matmul path at every length and dtype, so it computes what Transformers' eager attention computes.

The matmul path is three kernels: one batched GEMM per key/value head that writes the scaled scores with
the mask added (``baddbmm``: the heads sharing a key/value head are one matrix, the mask an additive bias
in the input dtype), PyTorch's softmax, which reads bf16/fp16 and accumulates in float32, and a second
batched GEMM. Written as ``softmax(scores.float())`` with a separate mask pass, the same arithmetic took
2x as long forward+backward under torch.compile (float32 score copies in and out of memory;
benchmarks/results_archive/2026-12.md, 2026-12-03). The forward output is the same as a float32 softmax
rounded to the input dtype; the backward starts from the rounded probabilities. Fully masked query rows (left
padding) get a finite uniform softmax instead of NaN. It saves the ``[b, heads, q, k]`` probabilities for
backward (flash saves none), bounded by the length limit. The choice depends only on shapes and dtypes, so a
recomputation under gradient checkpointing takes the same path as the forward it replays.

`register` makes the function and its mask builder (`one_row_mask`: SDPA's boolean masks, none for one
row) known to Transformers under `NAME`; ``model.attn_implementation=auto`` selects it on CPU
(`fusedrl.workers.fsdp.resolve_attn_implementation`).
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
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``softmax(q k^T * scaling + mask) v`` with grouped-query heads (the softmax accumulates in float32).

    query: [b, h, q, d]; key, value: [b, kvh, k, d] with kvh dividing h; mask: [b | 1, 1, q, k], boolean
    (True attends) or additive, or None (then causal, aligned to the last key, when ``causal``).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); ``dropout``:
    on the probabilities, as Transformers' eager attention. Returns [b, h, q, d].
    """
    b, h, q_len, d = query.shape
    kvh, k_len = key.shape[1], key.shape[2]
    group = h // kvh
    # The heads sharing one key/value head are the rows of one matrix: [b * kvh, group * q, d].
    q3 = query.reshape(b * kvh, group * q_len, d)
    k3 = key.reshape(b * kvh, k_len, d)
    bias = _score_bias(mask, causal, (b, kvh, group, q_len, k_len), query.dtype, query.device)
    if softcap is None:
        scores = attention_scores(q3, k3, bias, scaling)  # [b * kvh, group * q, k]
    else:  # the cap applies to the scores, the mask after it
        scores = torch.tanh(attention_scores(q3, k3, None, scaling) / softcap) * softcap
        scores = scores if bias is None else scores + bias  # [b * kvh, group * q, k]
    probs = torch.softmax(scores, dim=-1)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    out = torch.bmm(probs, value.reshape(b * kvh, k_len, d))  # [b * kvh, group * q, d]
    return out.view(b, h, q_len, d)


@torch.library.custom_op("fusedrl::attention_scores", mutates_args=())
def attention_scores(
    q3: torch.Tensor, k3: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """``bias + scaling * q3 @ k3^T`` whose key gradient comes out in the keys' own ``[k, d]`` layout
    (``dS^T @ q3``). Through autograd's ``baddbmm`` it arrives as the transpose of a ``[d, k]`` product,
    and a packed row's gather of the keys then scatters it back element by element: 18% of a shared-prompt
    micro-batch's attention (forward + backward, bf16, one thread, compiled;
    benchmarks/results_archive/2026-12.md, 2026-12-03). A custom op with its own autograd formula, not an
    ``autograd.Function``: a compiled layer's grad graph holding the latter (a higher-order op to dynamo) is
    not kept by AOTAutograd's cache, and every run traced it again (`fusedrl.workers.layer_compile`)."""
    if bias is None:
        return torch.bmm(q3, k3.transpose(1, 2)) * scaling
    return torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scaling)


@attention_scores.register_fake
def _attention_scores_shape(
    q3: torch.Tensor, k3: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    return q3.new_empty(q3.shape[0], q3.shape[1], k3.shape[1])


def _attention_scores_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    q3, k3, _, scaling = inputs
    ctx.save_for_backward(q3, k3)
    ctx.scaling = scaling


def _attention_scores_backward(ctx, grad: torch.Tensor):
    q3, k3 = ctx.saved_tensors
    grad_q = torch.bmm(grad, k3) * ctx.scaling if ctx.needs_input_grad[0] else None
    grad_k = torch.bmm(grad.transpose(1, 2), q3) * ctx.scaling if ctx.needs_input_grad[1] else None
    return grad_q, grad_k, None, None


attention_scores.register_autograd(_attention_scores_backward, setup_context=_attention_scores_setup)


def _score_bias(
    mask: torch.Tensor | None,
    causal: bool,
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """`matmul_attention`'s mask as an additive ``[b * kvh, group * q, k]`` bias in ``dtype`` (0 where a
    query attends, the dtype's lowest finite value where it does not), or None when nothing is masked."""
    b, kvh, group, q_len, k_len = shape
    if mask is None:
        if not (causal and q_len > 1):
            return None
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    lowest = torch.finfo(dtype).min
    if mask.dtype == torch.bool:
        bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~mask, lowest)
    else:  # additive; a float32 lowest or -inf would round to -inf in bf16 (NaN in a fully masked row)
        bias = mask.to(dtype).clamp(min=lowest)
    bias = bias.reshape(-1, 1, 1, q_len, k_len)  # [b | 1, 1, 1, q, k]
    if bias.shape[0] == 1:  # one mask for every row: [1, group * q, k], broadcast by baddbmm, not copied
        return bias.expand(1, 1, group, q_len, k_len).reshape(1, group * q_len, k_len)
    return bias.expand(b, kvh, group, q_len, k_len).reshape(b * kvh, group * q_len, k_len)


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
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    *,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: ``[1, h, N, d]`` query, ``[1, kvh, N, d]``
    key/value -> ``[1, h, N, d]``; ``window`` / ``softcap``: the layer's sliding window and logit cap
    (`_causal_attention`).

    Transformers gives SDPA a block-diagonal ``[N, N]`` mask for a packed row, and PyTorch's CPU kernels
    compute every block of it, masked or not: attention costs ``N^2`` instead of the sum of the sequences'
    squares (32 sequences of 100 tokens: 32x the work). Here, when every sequence is shorter than
    `MATMUL_BELOW`, the sequences are laid out as the rows of one padded batch (one kernel call instead of
    one per sequence: the calls' fixed cost dominates at these lengths) with the kernel an unpacked batch
    would get; longer sequences get their own causal attention one at a time."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if max(lengths) < MATMUL_BELOW:
        layout = segment_layout(lengths)
        return segments_attention(query, key, value, layout, scaling=scaling, window=window, softcap=softcap)
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        outs.append(_causal_attention(q, k, v, scaling=scaling, window=window, softcap=softcap))
    return torch.cat(outs, dim=2)  # [1, h, N, d]


def _window_mask(length: int, window: int | None, device: Any) -> torch.Tensor | None:
    """``[L, L]`` boolean causal mask of a sliding window (query ``i`` sees keys ``i - window < j <= i``,
    Transformers' ``sliding_window_overlay``), or None when the window covers the whole sequence."""
    if window is None or window >= length:
        return None
    index = torch.arange(length, device=device)
    behind = index[:, None] - index[None, :]  # [L, L]: how far each key lies before each query
    return (behind >= 0) & (behind < window)


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention (``[b, h, L, d]`` query, ``[b, kvh, L, d]`` key/value, no padding before the last
    real token of a row) by the kernel an unpacked batch of these shapes gets: `matmul_attention` or SDPA.
    ``window``: keys further back than the sliding window are masked; ``softcap``: the matmul path,
    which caps the scores."""
    mask = _window_mask(k.shape[2], window, q.device)  # [L, L] | None
    if softcap is not None or takes_matmul_path(q, k, 0.0):
        return matmul_attention(
            q, k, v, None if mask is None else mask[None, None], scaling=scaling, causal=True, softcap=softcap
        )
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )


# The keyword a packed forward of a compiled model passes its `segment_layout` under: Transformers hands
# the model's extra keywords down to every attention call.
LAYOUT_KWARG = "fusedrl_segments"


def segment_layout(
    lengths: list[int], *, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token of a packed row goes in a right-padded ``[S, L]`` batch of its sequences:
    ``(row [N], col [N], real [S, L])``, ``real`` True at the slots that hold a token. ``lengths``: the
    sequences' lengths in row order."""
    longest = max(max(lengths), 1)
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)  # [S]
    sizes = torch.tensor(lengths, device=device)  # [S]
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)  # [N]
    col = torch.arange(sum(lengths), device=device) - starts[row]  # [N]
    real = torch.arange(longest, device=device)[None] < sizes[:, None]  # [S, L]
    return row, col, real


def segments_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`packed_attention` through a `segment_layout`: scatter the row's tokens into a right-padded
    ``[S, heads, L, d]`` batch, attend causally, gather the tokens back (all differentiable; the shapes are the
    layout's tensors' sizes, so a compiled layer reads no sequence boundary as a Python number).

    The causal mask alone is exact here: a sequence's padding sits after its last token, so every key a
    real query may see (at or before its own position) is real. Only the padding queries see padding keys,
    and their outputs are never gathered. One ``[L, L]`` mask then serves every sequence and head."""
    row, col, real = layout
    s_count, longest = real.shape

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, N, d] -> [S, H, L, d], contiguous
        rows = x.new_zeros(s_count, x.shape[1], longest, x.shape[3])
        rows[row, :, col] = x[0].transpose(0, 1)  # [N, H, d] into their (sequence, position) slots
        return rows

    q, k, v = to_rows(query), to_rows(key), to_rows(value)
    out = _causal_attention(q, k, v, scaling=scaling, window=window, softcap=softcap)  # [S, h, L, d]
    return out[row, :, col].transpose(0, 1)[None]  # [1, h, N, d]


# The keyword a packed forward with shared prompts (`fusedrl.workers.packing.pack_shared_prompts`) passes
# its `fusedrl.workers.packing.shared_prompt_layout` under.
SHARED_LAYOUT_KWARG = "fusedrl_shared_prompts"


def shared_segments_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...],
    *,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a packed row whose samples share their prompt's tokens: ``[1, h, N, d]`` ->
    ``[1, h, N, d]``. ``layout``: `fusedrl.workers.packing.shared_prompt_layout`, one padded call per
    ``(src [S, L], dst [n], tokens [n])``: gather each of its samples' whole sequence (the shared prompt,
    then its own tokens) into row ``i`` of a right-padded ``[S, heads, L, d]`` batch, attend causally,
    and read the output of each of ``tokens`` from slot ``dst``. A shared prompt token is a key of every
    sample of its group; its gradient arrives summed over them (the gather's backward)."""
    rows_of = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, H, d] each
    outs = []
    for src, dst, _ in layout:
        s_count, longest = src.shape
        flat = src.flatten()  # [S * L]
        q, k, v = (
            x[flat].view(s_count, longest, x.shape[1], x.shape[2]).transpose(1, 2).contiguous()
            for x in rows_of
        )  # [S, H, L, d] each
        out = _causal_attention(q, k, v, scaling=scaling, window=window, softcap=softcap)  # [S, h, L, d]
        outs.append(
            out.transpose(1, 2).reshape(s_count * longest, out.shape[1], out.shape[3])[dst]
        )  # [n, h, d]
    if len(outs) == 1:  # one call holds every token, in order
        return outs[0].transpose(0, 1)[None]  # [1, h, N, d]
    tokens = torch.cat([t for _, _, t in layout])  # [N]: a permutation of the row's tokens
    gathered = torch.cat(outs)  # [N, h, d]
    return gathered.new_empty(gathered.shape).index_copy(0, tokens, gathered).transpose(0, 1)[None]


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
    """A Transformers attention function (``[b, h, q, d]`` inputs, ``[b, q, h, d]`` output). Reads the
    layer's ``sliding_window`` and ``softcap`` keywords (Transformers passes them to every attention
    function); a row without a mask (`one_row_mask`) gets its window here."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and not kwargs.get("output_attentions")
    )
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    packable = plain and causal and dropout == 0.0
    shape = {"scaling": scale, "window": window, "softcap": softcap}
    shared = kwargs.get(SHARED_LAYOUT_KWARG)
    if shared is not None:
        tokens = sum(call[1].shape[0] for call in shared)  # every token of the row reads one call's output
        if not (packable and query.shape[0] == 1 and query.shape[2] == tokens):
            raise ValueError(
                "a packed row with shared prompts reached an attention call that cannot run it (dropout, "
                "bidirectional or a KV cache): set actor_rollout_ref.model.share_prompt_prefix=false"
            )
        return shared_segments_attention(query, key, value, shared, **shape).transpose(
            1, 2
        ).contiguous(), None
    layout = kwargs.get(LAYOUT_KWARG)
    if packable and layout is not None and query.shape[0] == 1 and query.shape[2] == layout[0].shape[0]:
        return segments_attention(query, key, value, layout, **shape).transpose(1, 2).contiguous(), None
    bounds = packed_segments(kwargs.get("position_ids"), query, key) if packable else None
    one_row = query.shape[0] == 1 and attention_mask is None and query.shape[2] == key.shape[2]
    if bounds is None and packable and one_row and window is not None and query.shape[2] > window:
        bounds = [0, query.shape[2]]  # one sequence longer than its window got no mask (`one_row_mask`)
    if bounds is not None:
        return packed_attention(query, key, value, bounds, **shape).transpose(1, 2).contiguous(), None
    if not (plain and (softcap is not None or takes_matmul_path(query, key, dropout))):
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
        query, key, value, attention_mask, scaling=scale, causal=causal, softcap=softcap, dropout=dropout
    )  # [b, h, q, d]
    return out.transpose(1, 2).contiguous(), None


def one_row_mask(**mask_kwargs: Any) -> torch.Tensor | None:
    """The mask builder registered with `attention`: Transformers' ``sdpa_mask``, except None for a causal
    mask of one row without padding and without cache (a packed row, or one unpadded sequence), which
    `attention` attends correctly without a mask: sequences from the restarting ``position_ids`` (that
    Transformers passes to every attention call, as its FlashAttention-2 path reads packed rows) or the
    carried layout, sliding windows per sequence (`_window_mask`). Transformers would otherwise build the
    packed row's ``[N, N]`` block-diagonal mask once per forward, 10-25 ms on a 4k-token row.

    Kept (SDPA's mask): padded batches, cached keys, custom patterns (``use_vmap``: an ``or``/``and`` mask
    function), bidirectional models and models with attention dropout (whose training forwards `attention`
    hands to SDPA with the mask), and devices other than the CPU."""
    from transformers.masking_utils import sdpa_mask

    config = mask_kwargs.get("config")
    q_offset, kv_offset = mask_kwargs.get("q_offset", 0), mask_kwargs.get("kv_offset", 0)
    one_row = (
        mask_kwargs.get("batch_size") == 1
        and mask_kwargs.get("attention_mask") is None
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset == kv_offset == 0
        and mask_kwargs.get("q_length") == mask_kwargs.get("kv_length")
        and not mask_kwargs.get("use_vmap", False)
        and torch.device(mask_kwargs.get("device", "cpu")).type == "cpu"
    )
    causal_model = (
        config is not None
        and getattr(config, "is_causal", True)
        and not getattr(config, "use_bidirectional_attention", False)
        and not float(getattr(config, "attention_dropout", 0.0) or 0.0)
    )
    if one_row and causal_model:
        return None
    return sdpa_mask(**mask_kwargs)


def register() -> str:
    """Make `attention` (with its mask builder `one_row_mask`) available as ``attn_implementation=NAME``;
    returns `NAME`. Idempotent: every process that loads a model calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, one_row_mask)
    return NAME
