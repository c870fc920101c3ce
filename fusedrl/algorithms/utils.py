"""Masked reductions shared by the advantage estimators and the policy losses.

Responses in a batch are right-padded to a common length, so every statistic has to be taken over
the valid tokens only; a padded position must never move a mean, a variance or a loss.
"""

from __future__ import annotations

import torch

# Keeps 0 / 0 at 0 for an all-padding selection instead of producing NaN.
_TINY = 1e-8


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is non-zero (weighted by ``mask``).

    No paper: plain bookkeeping. ``torch.where`` (rather than only ``x * mask``) keeps a NaN or inf
    sitting at a padded position out of the result, since ``nan * 0`` is still NaN.
    """
    weighted = torch.where(mask != 0, x * mask, torch.zeros_like(x))  # [B, T]
    return weighted.sum() if dim is None else weighted.sum(dim=dim)  # [] or reduced


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the valid positions; 0 where there is no valid position.

    No paper: plain bookkeeping.
    """
    total = masked_sum(x, mask, dim)  # [] or reduced
    count = mask.sum() if dim is None else mask.sum(dim=dim)  # [] or reduced
    return total / count.to(total.dtype).clamp_min(_TINY)  # [] or reduced


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid positions (one scalar for the whole tensor).

    No paper: Bessel's correction ``n / (n - 1)`` is applied when ``unbiased`` and there are at
    least two valid positions; with fewer the biased value (0) is returned rather than raising, so
    that a degenerate micro-batch does not crash a training step.
    """
    mean = masked_mean(x, mask)  # []
    centered_sq = (x - mean) ** 2  # [B, T]
    var = masked_mean(centered_sq, mask)  # []
    if unbiased:
        count = mask.sum().to(var.dtype)  # []
        # Only correct when n > 1; otherwise the factor would divide by zero.
        factor = torch.where(count > 1, count / (count - 1).clamp_min(_TINY), torch.ones_like(count))  # []
        var = var * factor  # []
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``x`` with the mean and unbiased variance of its valid positions.

    No paper: the usual advantage normalisation of PPO implementations. With ``shift_mean=False``
    only the scale changes, and the mean is added back so the sign of a batch is kept.
    Padded positions are returned as they come out of the formula; callers multiply by the mask.
    """
    mean = masked_mean(x, mask)  # []
    var = masked_var(x, mask, unbiased=True)  # []
    whitened = (x - mean) * torch.rsqrt(var + _TINY)  # [B, T]
    if not shift_mean:
        whitened = whitened + mean  # [B, T]
    return whitened
