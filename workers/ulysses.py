"""Ulysses sequence parallelism: one packed sequence split over the ranks of a sequence-parallel group.

Reference: "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models" (arXiv 2309.14509); verl's ``ulysses_sequence_parallel_size`` keys.

With ``sp`` ranks in a group, the micro-batch is packed (`fusedrl.workers.packing`: real tokens end to end,
positions restarting per sequence), padded to a multiple of ``sp``, and rank ``r`` keeps the ``r``-th of
``sp`` equal slices of the tokens. Every layer except attention works token by token, so each rank runs
embeddings, norms, MLPs, rotary embeddings (the slice's own positions) and the LM head on its slice only:
activations and logits shrink ``sp`` times. Attention needs every token: before it, one all-to-all turns
``[b, heads, tokens/sp, d]`` (all heads, my tokens) into ``[b, heads/sp, tokens, d]`` (my heads, all tokens);
attention runs per head as usual, with the packed sequences' block-diagonal causal mask built from the
full position ids; a second all-to-all turns the result back. The backward of an all-to-all is the
all-to-all the other way, so gradients reach the rank that owns each token.

The per-token results (log-probs, entropy) are gathered along the tokens at the end (`gather_tokens`):
every rank of the group then holds the whole micro-batch's results and computes the same loss. Each
rank's parameter gradients cover the tokens it owns, so the group's sum is the full gradient. FSDP2 over
all ranks *averages* gradients, so the gather's backward scales by ``sp`` (``grad_scale``): the
average over the ``sp`` ranks of a group is then their sum.

Attention runs through transformers' attention-function registry (the name `ATTN_NAME`), so any model
whose attention calls that registry (Llama, Qwen2/3, Mistral, Gemma 1-3, ...) is covered; `ulysses_forward`
switches the model to it for one forward. The layer's sliding window and logit soft-cap (the
``sliding_window`` / ``softcap`` keywords Transformers passes every attention function) apply per
sequence as in fusedrl's CPU attention. Requirements: ``num_attention_heads % sp == 0``; key/value heads are
repeated first when ``num_key_value_heads % sp != 0``. torch.distributed's ``all_to_all`` runs on gloo
(CPU) and NCCL alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.batch import RolloutBatch
from fusedrl.workers.chunked_head import head_log_probs
from fusedrl.workers.packing import pack_batch

ATTN_NAME = "fusedrl_ulysses"


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """All-to-all: split ``x`` into ``sp`` chunks along ``scatter_dim``, send chunk ``r`` to rank ``r``, and
    concatenate the chunks received (in rank order) along ``gather_dim``."""
    sp = dist.get_world_size(group)
    inputs = [c.contiguous() for c in x.chunk(sp, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(sp)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, group: Any, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (see `_exchange`); its backward is the reverse exchange."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, grad_scale: float) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.grad_scale = group, dim, grad_scale
        ctx.rank, ctx.size = dist.get_rank(group), x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Every rank computes the same loss from the gathered tensor; the gradient of its own slice is
        # this rank's share (scaled so that FSDP's average over the group is the sum).
        mine = grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size) * ctx.grad_scale
        return mine, None, None, None


def gather_tokens(x: torch.Tensor, group: Any, *, dim: int, grad_scale: float = 1.0) -> torch.Tensor:
    """Concatenate every group rank's slice of ``x`` along ``dim`` (rank order); differentiable: the backward
    returns this rank's slice of the gradient times ``grad_scale``."""
    return _GatherTokens.apply(x, group, dim, grad_scale)


@dataclass
class _Active:
    group: Any
    segment: torch.Tensor  # [N] int64, the packed sequence each of the N (padded) tokens belongs to


_ACTIVE: _Active | None = None


def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` sequence index of each packed token: a new sequence starts wherever the position is 0."""
    return (position_ids == 0).long().cumsum(0)  # [N]


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``[b, h, n/sp, d]`` query, ``[b, h_kv, n/sp, d]`` key/value ->
    ``[b, n/sp, h, d]``): heads exchanged for tokens, block-diagonal causal attention over all ``n`` tokens,
    exchanged back. The mask comes from the full packed positions of the active `ulysses_forward`
    (``attention_mask`` is None: no mask function is registered for this implementation)."""
    active = _ACTIVE
    if active is None:
        raise RuntimeError(
            f"attention {ATTN_NAME!r} runs only inside fusedrl.workers.ulysses.ulysses_forward"
        )
    sp = dist.get_world_size(active.group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide num_attention_heads={heads}")
    if kv_heads % sp:  # too few key/value heads to split: give every query head its own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)  # [b, h, n/sp, d]
        value = value.repeat_interleave(heads // kv_heads, dim=1)  # [b, h, n/sp, d]
    q = all_to_all(query, active.group, scatter_dim=1, gather_dim=2)  # [b, h/sp, n, d]
    k = all_to_all(key, active.group, scatter_dim=1, gather_dim=2)  # [b, hkv/sp, n, d]
    v = all_to_all(value, active.group, scatter_dim=1, gather_dim=2)  # [b, hkv/sp, n, d]
    if k.shape[1] != q.shape[1]:  # grouped-query attention: kv head j serves q heads j*g .. j*g+g-1
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [b, h/sp, n, d]
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # [b, h/sp, n, d]
    seg = active.segment.to(q.device)  # [n]
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    scale = float(q.shape[-1] ** -0.5 if scaling is None else scaling)
    if q.device.type == "cpu" and dropout == 0.0 and q.shape[0] == 1:
        # PyTorch's CPU kernels would compute every block of the block-diagonal mask below (n^2 work):
        # attend within each sequence instead (see fusedrl.workers.cpu_attention.packed_attention).
        from fusedrl.workers.cpu_attention import packed_attention

        starts = (torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1).tolist()
        bounds = [0, *starts, int(seg.numel())]
        out = packed_attention(q, k, v, bounds, scaling=scale, window=window, softcap=softcap)
    else:
        out = masked_attention(q, k, v, seg, scaling=scale, window=window, softcap=softcap, dropout=dropout)
    out = all_to_all(out, active.group, scatter_dim=2, gather_dim=1)  # [b, h, n/sp, d]
    return out.transpose(1, 2).contiguous(), None  # [b, n/sp, h, d]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment: torch.Tensor,
    *,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of ``[b, h, n, d]`` heads over a packed row through its ``[n, n]`` mask (same sequence,
    causal, within the ``window`` when the layer has one): the path off CPU (or with dropout), where
    PyTorch's kernels take the mask. ``softcap`` (no SDPA kernel has it): `matmul_attention`'s capped
    scores. ``segment [n]``: the sequence of each token."""
    idx = torch.arange(segment.numel(), device=q.device)  # [n]
    behind = idx[:, None] - idx[None, :]  # [n, n]: how far each key lies before each query
    mask = (segment[:, None] == segment[None, :]) & (behind >= 0)  # [n, n]: same sequence, causal
    if window is not None:
        mask &= behind < window  # Transformers' sliding_window_overlay
    if softcap is not None:
        from fusedrl.workers.cpu_attention import matmul_attention

        return matmul_attention(
            q, k, v, mask[None, None], scaling=scaling, causal=True, softcap=softcap, dropout=dropout
        )
    return nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[None, None], dropout_p=dropout, scale=scaling
    )  # [b, h, n, d]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)


_register()


@contextlib.contextmanager
def _attention_of(model: nn.Module, name: str) -> Iterator[None]:
    # Every module's config (the model's and, for composite models, the text model's) names the attention.
    configs: dict[int, Any] = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    before = {key: cfg._attn_implementation for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg._attn_implementation = name
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = before[key]


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """This rank's slice of a packed micro-batch: ``input_ids`` / ``position_ids`` / ``next_ids`` ``[1, n/sp]``
    (``next_ids``: the token each position predicts), and the full ``[N]`` (padded) positions."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    next_ids: torch.Tensor
    full_positions: torch.Tensor


def slice_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, sp: int, rank: int) -> SequenceSlice:
    """Pad a packed ``[1, N]`` row to a multiple of ``sp`` (a separate trailing sequence of pad tokens, which
    no real token attends to) and take slice ``rank``."""
    n = input_ids.shape[1]
    pad = -n % sp
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], dim=1)  # [1, N']
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
    next_ids = torch.cat([input_ids[:, 1:], input_ids.new_zeros(1, 1)], dim=1)  # [1, N']
    size = input_ids.shape[1] // sp
    part = slice(rank * size, (rank + 1) * size)
    return SequenceSlice(input_ids[:, part], position_ids[:, part], next_ids[:, part], position_ids[0])


def ulysses_forward(model: nn.Module, piece: SequenceSlice, group: Any) -> torch.Tensor:
    """The model's logits ``[1, n/sp, V]`` for this rank's slice, attention spanning the whole packed row
    (under `fusedrl.workers.chunked_head`'s head: its per-token results ``[1, n/sp, k]``)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("ulysses_forward does not nest")
    _ACTIVE = _Active(group=group, segment=_segments(piece.full_positions))
    try:
        with _attention_of(model, ATTN_NAME):
            return model(
                input_ids=piece.input_ids,
                position_ids=piece.position_ids,
                attention_mask=None,
                use_cache=False,
            ).logits
    finally:
        _ACTIVE = None


def ulysses_response_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    group: Any,
    *,
    temperature: float,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    grad_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fusedrl.workers.logprob.response_log_probs` (packed) with the tokens split over ``group``: every rank
    passes the same ``batch`` and gets the same ``(log_probs [B, Tr], entropy [B, Tr] | None)``, 0 on
    padding. ``grad_scale``: see the module docstring (``sp`` under FSDP, 1 for a plain sum of gradients)."""
    packed, piece = _sliced(batch, group)
    log_probs, entropy = head_log_probs(
        model,
        lambda: ulysses_forward(model, piece, group)[0],  # [n/sp, V]
        piece.next_ids[0],
        temperature=temperature,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )  # [n/sp] each (entropy: or Σπ²)
    extra = None if entropy is None else _to_responses(entropy, packed, group, grad_scale)
    return _to_responses(log_probs, packed, group, grad_scale), extra


def ulysses_response_values(
    model: nn.Module, batch: RolloutBatch, group: Any, *, grad_scale: float = 1.0
) -> torch.Tensor:
    """A one-label token classifier's output (the critic's values) at the position predicting each
    response token, with the tokens split over ``group``: ``[B, Tr]`` float32, 0 on padding (as the packed
    path of `fusedrl.workers.critic.CriticRole`)."""
    packed, piece = _sliced(batch, group)
    logits = ulysses_forward(model, piece, group)  # [1, n/sp, 1]
    return _to_responses(logits[0, :, 0].float(), packed, group, grad_scale)  # [B, Tr]


def _sliced(batch: RolloutBatch, group: Any) -> tuple[Any, SequenceSlice]:
    """``batch`` packed, and this rank's slice of the packed row."""
    packed = pack_batch(batch)
    piece = slice_packed(
        packed.input_ids, packed.position_ids, dist.get_world_size(group), dist.get_rank(group)
    )
    return packed, piece


def _to_responses(local: torch.Tensor, packed: Any, group: Any, grad_scale: float) -> torch.Tensor:
    """``[n/sp]`` per-position results of this rank -> ``[B, Tr]``: gathered over the group, then the
    position predicting each response token is picked."""
    full = gather_tokens(local, group, dim=0, grad_scale=grad_scale)  # [N']
    return packed.unpack(full[packed.pred_index])  # [B, Tr]


def sp_group(sp: int) -> Any:
    """This rank's sequence-parallel group: consecutive ranks ``[k * sp, (k + 1) * sp)`` (the driver gives
    them the same rows); None when ``sp`` is 1. Collective: every rank creates every group, in order."""
    world = dist.get_world_size()
    if sp < 1 or world % sp:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} must be >= 1 and divide the world size {world}"
        )
    if sp == 1:
        return None
    mine = None
    for start in range(0, world, sp):
        group = dist.new_group(list(range(start, start + sp)))
        if start <= dist.get_rank() < start + sp:
            mine = group
    return mine


def check_heads(
    model: nn.Module, sp: int, key: str = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
) -> None:
    """ValueError naming the key when ``sp`` does not divide the model's attention heads."""
    heads = int(getattr(model.config, "num_attention_heads", 0) or 0)
    if sp > 1 and (heads == 0 or heads % sp):
        raise ValueError(
            f"{key}={sp} must divide the model's "
            f"num_attention_heads ({heads}): each rank of a sequence-parallel group attends with heads / sp heads"
        )
