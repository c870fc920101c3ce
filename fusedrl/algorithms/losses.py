"""Loss aggregation and the registered policy-gradient losses.

Losses are looked up by ``actor_rollout_ref.actor.policy_loss.loss_mode``.

Every policy loss has the call shape

    fn(log_prob [B, T], old_log_prob [B, T], advantages [B, T], response_mask [B, T], *,
       clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, global_norm)
        -> (loss [], metrics {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower": 0-d detached tensors})

Metrics stay on-device tensors so that a micro-batch loop does not synchronise with the GPU per step.
"""

from __future__ import annotations

import torch

from fusedrl.algorithms.registry import register_policy_loss
from fusedrl.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten

LOSS_AGG_KEY = "actor_rollout_ref.actor.loss_agg_mode"
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# exp() of more than ~88 overflows float32; +/-20 already means a probability ratio of ~5e8.
_LOG_RATIO_CLAMP = 20.0

__all__ = [
    "LOSS_AGG_KEY",
    "LOSS_AGG_MODES",
    "agg_denominator",
    "agg_loss",
    "gspo_policy_loss",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "vanilla_policy_loss",
]


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown loss aggregation mode {mode!r} (config key `{LOSS_AGG_KEY}`); "
            f"choose one of {list(LOSS_AGG_MODES)}"
        )


def _local_denominator(mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Count that normalises ``mode`` on this tensor alone (a 0-d tensor, no host sync)."""
    if mode == "token-mean":
        return mask.sum()  # []
    if mode == "seq-mean-token-sum-norm":
        # Dr. GRPO's constant: rows times the response width (or `loss_scale_factor`), independent of how
        # many tokens are actually valid.
        horizon = float(mask.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        return torch.tensor(float(mask.shape[0]) * horizon, device=mask.device)  # []
    # Fully masked rows (e.g. rows padded in to balance data-parallel ranks) are not sequences.
    return (mask.sum(dim=-1) > 0).sum()  # []


def agg_denominator(mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None) -> float:
    """This split's share of the global normaliser of ``agg_loss`` in ``mode``.

    No paper: bookkeeping. Summing the value over every micro-batch and data-parallel rank of a
    mini-batch and passing the sum as ``global_norm`` makes ``sum_splits agg_loss(split)`` equal
    ``agg_loss(full mini-batch)``. Counts: valid tokens for "token-mean", non-empty sequences for
    the "seq-mean-*" modes, ``rows * T`` for "seq-mean-token-sum-norm" (``rows * loss_scale_factor``
    when that is set: ``actor_rollout_ref.actor.loss_scale_factor``, verl's constant horizon).
    """
    _check_mode(mode)
    return float(_local_denominator(mask, mode, loss_scale_factor).item())


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_norm: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    Papers: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476) for
    "token-mean" (long responses are not down-weighted per token); "DeepSeekMath" (arXiv 2402.03300)
    for "seq-mean-token-mean"; "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv 2503.20783) for "seq-mean-token-sum-norm" (a constant normaliser, no length bias).

    ``global_norm`` replaces the local denominator (see ``agg_denominator``) so that a mini-batch
    split over micro-batches / data-parallel ranks gives the same gradient as the unsplit batch.
    ``loss_scale_factor`` replaces ``T`` in the local "seq-mean-token-sum-norm" denominator.
    A denominator of 0 (nothing valid) yields a loss of 0 rather than NaN.
    """
    _check_mode(mode)
    mask = mask.to(loss_mat.dtype)  # [B, T]
    if mode == "token-mean" or mode == "seq-mean-token-sum-norm":
        numerator = masked_sum(loss_mat, mask)  # []
    elif mode == "seq-mean-token-sum":
        numerator = masked_sum(loss_mat, mask, dim=-1).sum()  # []
    else:
        per_seq = masked_mean(loss_mat, mask, dim=-1)  # [B], 0 for fully masked rows
        numerator = per_seq.sum()  # []
    if global_norm is None:
        denom = _local_denominator(mask, mode, loss_scale_factor).to(numerator.dtype)  # []
    else:
        denom = torch.as_tensor(global_norm, dtype=numerator.dtype, device=numerator.device)  # []
    # With an empty denominator the numerator is 0 too; clamping keeps 0 / 0 at 0 without a branch.
    return numerator / denom.clamp_min(1e-8)  # []


def _upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Ratios near 1 and sums over ~1e5 tokens need more than bf16's 8 mantissa bits; [B, T] is cheap
    # to upcast (unlike logits), and autograd casts the gradient back to the input's dtype.
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return tuple(t.to(dtype) for t in tensors)  # [B, T] each


def _ratio_metrics(
    neg_log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    clipped_lower: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": masked_mean(clipped.to(mask.dtype), mask).detach(),  # []
        "ppo_kl": masked_mean(neg_log_ratio, mask).detach(),  # []
        "pg_clipfrac_lower": masked_mean(clipped_lower.to(mask.dtype), mask).detach(),  # []
    }


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_norm: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping (clip-higher) and dual-clip.

    Papers: "Proximal Policy Optimization Algorithms" (arXiv 1707.06347) for the clipped surrogate;
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476) for a
    larger upper clip ``1 + clip_ratio_high``, which leaves room to raise low-probability tokens and
    so slows entropy collapse; "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning" (arXiv 1912.09729) for dual-clip: with A < 0 the plain surrogate grows without bound as
    the ratio grows, so the loss is capped at ``-A * clip_ratio_c``.

    Metrics: ``pg_clipfrac`` (share of valid tokens where the clipped branch was taken),
    ``ppo_kl`` (masked mean of ``old_log_prob - log_prob``), ``pg_clipfrac_lower`` (share where the
    dual-clip cap was taken).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [B, T]
    # max() of the two negated objectives == min() of the objectives: the pessimistic bound.
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    cap = -advantages * clip_ratio_c  # [B, T]
    negative_adv = advantages < 0  # [B, T]
    loss = torch.where(negative_adv, torch.minimum(loss_ppo, cap), loss_ppo)  # [B, T]

    clipped = loss_clipped > loss_unclipped  # [B, T]
    clipped_lower = negative_adv & (loss_ppo > cap)  # [B, T]
    pg_loss = agg_loss(loss, mask, loss_agg_mode, global_norm)  # []
    return pg_loss, _ratio_metrics(old_log_prob - log_prob, clipped, clipped_lower, mask)


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_norm: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: clip a length-normalised *sequence* importance ratio instead of per-token ratios.

    Paper: "Group Sequence Policy Optimization" (arXiv 2507.18071).
    ``s_i = exp(mean_t (log_prob - old_log_prob))`` over the valid tokens of sequence i. The
    token-level form ``log s_{i,t} = sg(log s_i) + log_prob_t - sg(log_prob_t)`` has the value of
    ``s_i`` at every token but routes the gradient through each token's own log-prob, which lets
    token-level advantages be used. The paper's clip ranges are much smaller than PPO's (order
    3e-4 / 4e-4); pass them via ``clip_ratio_low`` / ``clip_ratio_high``. ``clip_ratio_c`` is
    accepted for a uniform call shape and unused (no dual-clip); ``pg_clipfrac_lower`` is then 0.

    The paper averages per sequence, so the policy term is aggregated with "seq-mean-token-mean"
    whatever ``loss_agg_mode`` says (``agg_mode`` below; ``global_norm`` must be that mode's, which
    the actor passes); the entropy and KL terms keep ``loss_agg_mode``, as in verl.
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    token_log_ratio = log_prob - old_log_prob  # [B, T]
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)  # [B]
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()  # [B, T]
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [B, T]
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]

    clipped = loss_clipped > loss_unclipped  # [B, T]
    no_dual_clip = torch.zeros_like(clipped)  # [B, T]
    pg_loss = agg_loss(loss, mask, "seq-mean-token-mean", global_norm)  # []
    return pg_loss, _ratio_metrics(-token_log_ratio, clipped, no_dual_clip, mask)


# The aggregation of the policy term that the paper fixes (see `register_policy_loss`).
gspo_policy_loss.agg_mode = "seq-mean-token-mean"  # type: ignore[attr-defined]
