"""Per-token log-probs, entropy and Σπ² from the LM head without a micro-batch's full-vocabulary logits.

With a large vocabulary the logits dominate a training step's memory: SmolLM2's 49,152 tokens make
``[M, V]`` float32 logits of a micro-batch's ``M`` response positions 192 KiB per position, and the
log-softmax, the entropy's softmax and autograd's saved tensors hold several more of them. Here the head
runs on ``[R, Vc]`` tiles of at most `CHUNK_ELEMENTS` logits (`tile_shape`: up to `TILE_ROWS` positions
by as many vocabulary entries as fit) and keeps only per-token results:

* forward: per tile of positions, the vocabulary tiles one after the other with online softmax statistics
  (running maximum, normaliser, entropy or Σπ² sum; as in FlashAttention's softmax) -> log-prob, entropy
  or Σπ² and ``log Z``, ``[R]`` each; nothing of size ``V`` outlives its tile.
* backward: each tile's logits are recomputed and turned into their gradient in closed form from the
  saved per-token ``log Z`` and entropy or Σπ² (no autograd graph over the tile), then into the hidden
  states' and the head's gradients by two matrix products. The tiles are wide in positions on purpose:
  a product of few rows re-reads the whole ``[Vc, H]`` weight tile for little work (chunks of 42 rows of
  the 49k vocabulary ran the head's matmul 2.4x slower than 512 rows at once on the 2-core EPYC), and
  each tile writes its own slice of the weight gradient instead of adding a ``[V, H]`` product per chunk.

The extra cost is one recomputed head matmul in the backward (the forward's logits are not kept); the
closed-form gradient and the online statistics replace the dozen ``[M, V]`` elementwise passes (two
``logsumexp``, a softmax, autograd's saved copies and their backward) of the whole-logits path
(benchmarks/logprob_memory.py measures both).

The head must run inside the model's own forward: under FSDP2 the root unit's parameters (the LM head and,
tied, the embedding) are gathered only between its pre- and post-forward hooks, and the gradient must
reach the gathered parameter that FSDP2 reduce-scatters after the backward. So `head_token_stats` swaps the
head module's ``forward`` for the call (the instance attribute; the module and its parameters stay in
place, so state dicts, weight streams and tied weights are untouched) and the model returns the per-token
results ``[..., 1 or 2]`` float32 where it returned logits. The gradient flows through that very output
tensor, the one on which FSDP2 hooks its pre-backward.

Only where that is exact: a model type whose causal-LM forward returns ``lm_head(hidden)`` unchanged
(`MODEL_TYPES`; not Gemma-2's soft-capping or Granite's scaling) and a plain ``nn.Linear`` head (not a
PEFT-adapted one). Elsewhere, and when the micro-batch's logits fit in one chunk (a tiny model's), the
logits are computed whole as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fusedrl.algorithms import entropy_from_logits

logger = logging.getLogger(__name__)

# Logits per tile: 16 MiB in float32. The peak of a pass holds ~2-3 of them (the head's output, its
# exponentials, the gradient's factors).
CHUNK_ELEMENTS = 1 << 22
# Positions per tile at most (`tile_shape`): the vocabulary tile is then ``CHUNK_ELEMENTS // rows`` wide.
TILE_ROWS = 1024
# A module switch so that benchmarks and tests can run the whole-logits path side by side.
ENABLED = True

# Model types whose ``*ForCausalLM.forward`` returns ``self.lm_head(hidden_states[:, slice_indices, :])``
# as its logits with nothing applied after it (transformers 5.x; checked in their modeling files).
MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "ministral",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "phi3",
        "olmo2",
        "gemma",
        "smollm3",
    }
)
_PLAIN_HEAD = "_fusedrl_plain_head"  # set on a model whose output was not the chunked head's: never again

EXTRAS = (None, "entropy", "sum_pi_squared")


def output_head(model: nn.Module) -> nn.Linear | None:
    """``model``'s LM head when the chunked path is exact for it (module docstring), else None."""
    from fusedrl.workers.layer_compile import RowMajorGradLinear

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    if getattr(base, _PLAIN_HEAD, False) or not type(base).__name__.endswith("ForCausalLM"):
        return None
    if getattr(getattr(base, "config", None), "model_type", None) not in MODEL_TYPES:
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None  # type: ignore[operator]
    # A PEFT-adapted head is a LoraLayer (not an nn.Linear); a subclass may compute something else.
    return head if type(head) in (nn.Linear, RowMajorGradLinear) else None


def head_token_stats(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    targets: torch.Tensor,
    *,
    temperature: float,
    extra: str | None,
    whole: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs, extra)`` ``[...]`` (float32) of ``targets [...]`` under ``softmax(logits / temperature)``,
    ``extra`` the entropy, Σπ² or None (`EXTRAS`).

    ``forward()`` runs ``model`` and returns its ``.logits`` at the positions predicting ``targets`` (an
    indexing of the model's output is fine: ``out.logits[0]``). Chunked when `output_head` allows it and the
    logits would exceed `CHUNK_ELEMENTS`: the model then returns the results ``[..., k]`` instead of logits.
    Otherwise ``whole(forward())`` (the whole-logits math on ``[..., V]``)."""
    if extra not in EXTRAS:
        raise ValueError(f"head_token_stats: extra must be one of {EXTRAS}, got {extra!r}")
    head = output_head(model) if ENABLED else None
    if head is None or targets.numel() * head.out_features <= CHUNK_ELEMENTS:
        return whole(forward())
    with _chunked_forward(head, targets, temperature, extra) as returned:
        out = forward()  # [..., k]
    if not returned or not _same_storage(out, returned[0]):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
        logger.warning(
            "%s: the LM head's output is not the model's logits; computing whole logits from now on",
            type(base).__name__,
        )
        setattr(base, _PLAIN_HEAD, True)
        return whole(forward())
    return out[..., 0], None if extra is None else out[..., 1]


def whole_token_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [..., V]`` of the positions predicting ``targets [...]`` -> ``(log_probs, extra)`` ``[...]``:
    ``extra`` is the entropy (``with_entropy``), Σπ² = ``sum_v pi(v)^2`` (``with_sum_pi_squared``, read by
    the optimal token baseline), or None."""
    if with_entropy and with_sum_pi_squared:
        raise ValueError("token log-probs: ask for the entropy or for sum_pi_squared, not both")
    logits = logits.float()  # [..., V]
    if temperature != 1.0:  # x / 1.0 == x bit for bit: skip a pass over the whole logits
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)  # [...]
    token_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
    extra = entropy_from_logits(logits) if with_entropy else None  # [...]
    if with_sum_pi_squared:
        # sum_v exp(2 z_v) / Z^2, in log space: no probability is squared after rounding to 0.
        extra = torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * log_z)  # [...]
    return token_logits - log_z, extra


def head_log_probs(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    with_sum_pi_squared: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`whole_token_log_probs` of the logits ``forward()`` returns (``model``'s ``.logits`` at the positions
    predicting ``targets [...]``, ``[..., V]``), computed chunk by chunk inside that forward where the whole
    logits would be large (`head_token_stats`)."""
    if with_entropy and with_sum_pi_squared:
        raise ValueError("token log-probs: ask for the entropy or for sum_pi_squared, not both")
    return head_token_stats(
        model,
        forward,
        targets,
        temperature=temperature,
        extra="entropy" if with_entropy else "sum_pi_squared" if with_sum_pi_squared else None,
        whole=lambda logits: whole_token_log_probs(
            logits,
            targets,
            temperature=temperature,
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared,
        ),
    )


def _same_storage(out: torch.Tensor, returned: torch.Tensor) -> bool:
    """Whether ``out`` is ``returned`` or a view of it (not a result computed from it)."""
    return (
        out.untyped_storage().data_ptr() == returned.untyped_storage().data_ptr()
        and out.numel() == returned.numel()
    )


@contextmanager
def _chunked_forward(
    head: nn.Linear, targets: torch.Tensor, temperature: float, extra: str | None
) -> Iterator[list[torch.Tensor]]:
    """Inside: ``head(hidden [..., H])`` returns `chunked_token_stats` ``[..., k]`` of ``targets`` (one per
    position of ``hidden``, in its order: ``[M]`` for a packed ``[1, M, H]``) instead of logits; the list
    receives what it returned, to check that the model passed it on unchanged."""
    returned: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if returned:
            raise RuntimeError("the chunked LM head was called twice in one forward")
        if hidden.shape[:-1].numel() != targets.numel():
            raise RuntimeError(
                f"chunked LM head: hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}"
            )
        stats = chunked_token_stats(
            hidden,
            head.weight,
            head.bias,
            targets.reshape(hidden.shape[:-1]),
            temperature=temperature,
            extra=extra,
        )  # [..., k]
        returned.append(stats)
        return stats

    before = head.__dict__.get("forward")  # an instance's own forward (someone else's patch), if any
    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield returned
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before  # type: ignore[method-assign]


def chunked_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float,
    extra: str | None = None,
) -> torch.Tensor:
    """``hidden [..., H]``, head ``weight [V, H]`` (``bias [V]``), ``targets [...]`` -> ``[..., k]`` float32:
    the log-prob of each target under ``softmax(linear(hidden) / temperature)`` and, with ``extra``, the
    entropy or Σπ² of that distribution; differentiable in ``hidden``, ``weight`` and ``bias``."""
    return _ChunkedHeadStats.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        float(temperature),
        extra,
        targets.shape,
    )  # [..., k]


def tile_shape(positions: int, vocab: int) -> tuple[int, int]:
    """``(rows, width)`` of the ``[rows, width]`` logit tiles of `chunked_token_stats`: up to `TILE_ROWS`
    positions (fewer rows make the head's matrix products slower: each call re-reads the weight tile) and
    as many vocabulary entries as `CHUNK_ELEMENTS` allows."""
    rows = max(1, min(positions, TILE_ROWS))
    return rows, min(vocab, max(1, CHUNK_ELEMENTS // rows))


def _logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``linear(h, weight, bias) / temperature`` in float32, as a fresh tensor (safe to change in place)."""
    z = nn.functional.linear(h, weight, bias)  # [R, Vc] in the head's dtype, like the whole-logits path
    z = z.float() if z.dtype != torch.float32 else z  # [R, Vc]
    return z.div_(temperature) if temperature != 1.0 else z  # [R, Vc]


def _tile_targets(targets: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, columns)`` ``[h]`` each: the rows whose target lies in the vocabulary tile ``[v0, v0 +
    width)`` and its column there."""
    local = targets - v0  # [R]
    rows = ((local >= 0) & (local < width)).nonzero()[:, 0]  # [h]
    return rows, local[rows]


def _row_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    extra: str | None,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log_z, log_prob, extra)`` ``[R]`` of rows ``h [R, H]``, a vocabulary tile at a time.

    Online softmax statistics: with ``m`` the largest scaled logit so far, ``s = sum exp(z - m)``,
    ``a = sum exp(z - m) (z - m)`` (entropy: ``H = log s - a / s``) and ``q = sum exp(2 (z - m))`` (Σπ² =
    ``q / s^2``); a tile with a larger maximum ``m'`` rescales them by ``exp(m - m')`` (``a`` also shifts by
    ``(m - m') s``). Centred on the running maximum, no exponential overflows and the entropy never
    subtracts two large, nearly equal numbers (see `fusedrl.algorithms.entropy_from_logits`)."""
    vocab = weight.shape[0]
    picked = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)  # [R], target's scaled logit
    top = total = acc = torch.empty(0)
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        z = _logits(h, weight[v0:v1], None if bias is None else bias[v0:v1], temperature)  # [R, Vc]
        rows, cols = _tile_targets(targets, v0, v1 - v0)
        picked[rows] = z[rows, cols]
        new_top = z.amax(dim=-1) if v0 == 0 else torch.maximum(top, z.amax(dim=-1))  # [R]
        e = z.sub_(new_top[:, None]).exp()  # [R, Vc]; z now centred, <= 0
        tile_total = e.sum(dim=-1)  # [R]
        tile_acc = None
        if extra == "entropy":
            tile_acc = z.mul_(e).sum(dim=-1)  # [R], sum e (z - m')
        elif extra == "sum_pi_squared":
            tile_acc = e.mul_(e).sum(dim=-1)  # [R], sum e^2
        del z, e
        if v0 == 0:
            total, acc = tile_total, tile_acc
        else:
            shift = top - new_top  # [R], <= 0
            scale = shift.exp()  # [R]
            if extra == "entropy":
                acc = scale * (acc + shift * total) + tile_acc
            elif extra == "sum_pi_squared":
                acc = scale.square() * acc + tile_acc
            total = scale * total + tile_total
        top = new_top
    log_s = total.log()  # [R]
    log_z = top + log_s  # [R]
    if extra == "entropy":
        return log_z, picked - log_z, log_s - acc / total
    if extra == "sum_pi_squared":
        return log_z, picked - log_z, acc / total.square()
    return log_z, picked - log_z, None


class _ChunkedHeadStats(torch.autograd.Function):
    """`chunked_token_stats` on flat ``[N, H]`` hidden states (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        extra: str | None,
        shape: torch.Size,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        k = 1 if extra is None else 2
        # Allocated in the caller's shape and returned whole: FSDP2 hooks its pre-backward on the model's
        # output, and warns about an output that is a view.
        result = torch.empty(*shape, k, dtype=torch.float32, device=hidden.device)  # [..., k]
        out = result.view(n, k)  # [N, k]
        log_z = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        rows, width = tile_shape(n, weight.shape[0])
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            lz, lp, x = _row_stats(hidden[r0:r1], weight, bias, targets[r0:r1], temperature, extra, width)
            log_z[r0:r1], out[r0:r1, 0] = lz, lp
            if x is not None:
                out[r0:r1, 1] = x
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, out[:, 1:].clone())
        ctx.temperature, ctx.extra = temperature, extra
        return result

    @staticmethod
    def backward(ctx: Any, grad_result: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, log_z, x = ctx.saved_tensors
        temperature, extra = ctx.temperature, ctx.extra
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        n, vocab = hidden.shape[0], weight.shape[0]
        grad_out = grad_result.reshape(n, -1).float()  # [N, k]
        # d/d logits = d/dz / T for the scaled logits z: folded into the per-token factors once.
        g_lp = grad_out[:, 0] / temperature  # [N]
        g_x = grad_out[:, 1] / temperature if extra is not None else None  # [N]
        if g_x is not None and not bool(g_x.any()):  # e.g. entropy_coeff = 0: the entropy is not in the loss
            g_x = None
        rows, width = tile_shape(n, vocab)
        one_row_tile = rows == n
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # The weight gradient accumulates over row tiles: then in float32, cast once (bf16 heads).
        w_dtype, w_new = (weight.dtype, torch.empty) if one_row_tile else (torch.float32, torch.zeros)
        grad_w = w_new(weight.shape, dtype=w_dtype, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_b else None  # [V]
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            h = hidden[r0:r1]  # [R, H]
            acc_h = torch.zeros(r1 - r0, hidden.shape[1], dtype=torch.float32, device=hidden.device)  # [R, H]
            for v0 in range(0, vocab, width):
                v1 = min(v0 + width, vocab)
                w = weight[v0:v1]  # [Vc, H]
                gz = _tile_grad(
                    _logits(h, w, None if bias is None else bias[v0:v1], temperature),
                    log_z[r0:r1],
                    x[r0:r1],
                    _tile_targets(targets[r0:r1], v0, v1 - v0),
                    g_lp[r0:r1],
                    None if g_x is None else g_x[r0:r1],
                    extra,
                )  # [R, Vc], d loss / d logits
                if grad_b is not None:
                    grad_b[v0:v1] += gz.sum(0)
                g = gz.to(weight.dtype)  # [R, Vc], as autograd casts at the whole path's .float()
                del gz
                if grad_h is not None:
                    acc_h += (g @ w).float()  # [R, H]
                if grad_w is not None:
                    if one_row_tile:
                        torch.mm(g.t(), h, out=grad_w[v0:v1])  # [Vc, H]
                    else:
                        grad_w[v0:v1] += (g.t() @ h).float()  # [Vc, H]
            if grad_h is not None:
                grad_h[r0:r1] = acc_h
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def _tile_grad(
    z: torch.Tensor,
    log_z: torch.Tensor,
    x: torch.Tensor,
    hits: tuple[torch.Tensor, torch.Tensor],
    g_lp: torch.Tensor,
    g_x: torch.Tensor | None,
    extra: str | None,
) -> torch.Tensor:
    """The loss's gradient with respect to one tile's logits, from its scaled logits ``z [R, Vc]``
    (overwritten), the saved ``log_z [R]`` and extra ``x [R, 0 or 1]``, the output gradients (already
    divided by the temperature) ``g_lp [R]`` and ``g_x [R]`` (None when zero), and the rows whose target
    is in the tile with its column (`_tile_targets`).

    With ``p = softmax(z)``: ``d log p_t / dz = onehot(t) - p``; ``dH / dz = -p (log p + H)``;
    ``d sum p^2 / dz = 2 p (p - sum p^2)``."""
    log_p = z.sub_(log_z[:, None])  # [R, Vc]
    p = log_p.exp()  # [R, Vc]
    if g_x is None:
        grad = p.mul_(-g_lp[:, None])  # [R, Vc]
    elif extra == "entropy":
        coef = log_p.add_(x).mul_(g_x[:, None]).add_(g_lp[:, None])  # [R, Vc]
        grad = p.mul_(coef).neg_()  # [R, Vc]
    else:
        coef = (p - x).mul_(2.0 * g_x[:, None]).sub_(g_lp[:, None])  # [R, Vc]
        grad = p.mul_(coef)  # [R, Vc]
    rows, cols = hits
    grad[rows, cols] += g_lp[rows]  # the log-prob's onehot term
    return grad
