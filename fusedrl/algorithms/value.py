"""The critic's regression loss: squared error to the returns, with PPO-style value clipping.

Pure torch, no engine imports. Same conventions as the policy losses in `losses.py`: ``[B, T]`` inputs,
a padding mask, aggregation through `agg_loss` (so a ``global_norm`` makes micro-batch / data-parallel
splits add up to the unsplit mini-batch), and metrics returned as 0-d detached tensors so a micro-batch
loop does not synchronise with the device.
"""

from __future__ import annotations

import torch

from fusedrl.algorithms.losses import agg_loss
from fusedrl.algorithms.utils import masked_mean

__all__ = ["value_loss"]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_norm: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, ``V_clip = V_old + clip(V - V_old, +-c)``.

    Papers: "Proximal Policy Optimization Algorithms" (arXiv 1707.06347); the paper's objective has a
    plain squared-error value term, and the clipping around the rollout-time estimate comes from its
    released implementation (OpenAI Baselines' ppo2), which treats it like the ratio clip; "The 37
    Implementation Details of Proximal Policy Optimization" (Huang et al., ICLR Blog Track 2022) and
    "Implementation Matters in Deep Policy Gradients" (arXiv 2005.12729) for the exact form used here
    (the pessimistic max of the clipped and unclipped squared errors, scaled by 0.5) and the remark
    that it is an implementation choice rather than part of the PPO objective.

    Args:
        values: ``[B, T]`` current critic predictions (with grad).
        old_values: ``[B, T]`` predictions of the critic that produced the rollout's advantages.
        returns: ``[B, T]`` regression targets (advantages + old values, before whitening).
        response_mask: ``[B, T]`` 1 on valid response tokens, 0 on padding.
        cliprange_value: ``c``, the largest move of a prediction away from ``old_values`` that still
            earns a gradient from the clipped branch.
        loss_agg_mode / global_norm: as in `agg_loss`.

    Returns ``(loss [], metrics)`` with ``vf_clipfrac`` (share of valid tokens where the clipped
    squared error is the larger one, i.e. where the clipped branch sets the loss) and ``vpred_mean``
    (masked mean of ``values``).
    """
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    # Squared errors summed over many tokens want at least float32; autograd casts the grad back.
    dtype = torch.promote_types(values.dtype, torch.float32)
    values = values.to(dtype)  # [B, T]
    old_values = old_values.to(dtype)  # [B, T]
    returns = returns.to(dtype)  # [B, T]
    mask = response_mask.to(dtype)  # [B, T]

    v_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)  # [B, T]
    err_unclipped = (values - returns) ** 2  # [B, T]
    err_clipped = (v_clipped - returns) ** 2  # [B, T]
    loss_mat = 0.5 * torch.maximum(err_unclipped, err_clipped)  # [B, T]

    clipped = err_clipped > err_unclipped  # [B, T]
    loss = agg_loss(loss_mat, mask, loss_agg_mode, global_norm)  # []
    metrics = {
        "vf_clipfrac": masked_mean(clipped.to(dtype), mask).detach(),  # []
        "vpred_mean": masked_mean(values, mask).detach(),  # []
    }
    return loss, metrics
