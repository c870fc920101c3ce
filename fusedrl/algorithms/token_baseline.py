"""The optimal token baseline (OTB): a per-token, per-group baseline weighted by each path's gradient energy.

Registered as ``algorithm.adv_estimator=optimal_token_baseline`` (verl's name). It needs, per response
token, the old policy's probability of the sampled token (``old_log_probs``) and the sum of squared
probabilities over the vocabulary (``sum_pi_squared``, Σπ²). The actor's old-log-prob pass returns Σπ² when
the estimator's traits ask for it (`EstimatorTraits.needs_sum_pi_squared`): one extra log-sum-exp over the
logits it already has, no extra forward.
"""

from __future__ import annotations

from typing import Any

import torch

from fusedrl.algorithms.advantages import GroupIndex, _compute_dtype, _group_inverse
from fusedrl.algorithms.registry import register_adv_estimator

__all__ = [
    "compute_optimal_token_baseline_advantage",
    "compute_tir_optimal_token_baseline_advantage",
    "token_energy",
]


def token_energy(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` squared norm of the gradient of ``log pi(y_t)`` with respect to the logits at step t.

    That gradient is ``onehot(y_t) - pi``, whose squared norm is ``1 - 2 pi(y_t) + sum_v pi(v)^2``: the
    energy a token adds to the path's score-function gradient, from forward quantities only.
    """
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    pi_t = torch.exp(old_log_probs.to(dtype))  # [B, T]
    return 1.0 - 2.0 * pi_t + sum_pi_squared.to(dtype)  # [B, T]


@register_adv_estimator("optimal_token_baseline", needs_sum_pi_squared=True)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-to-go minus a baseline per token position that weights each group member by its path energy.

    Reference: the Optimal Token Baseline of verl (docs/algo/otb.md there) and its write-up,
    "Optimal Token Baseline" (R. Li, https://richardli.xyz/optimal-token-baseline). Minimising the
    variance of ``(G_t - b_t) * grad log pi(y_{<=t})`` over ``b_t`` gives ``b_t = E[G_t W_t] / E[W_t]``,
    where ``W_t = sum_{j<=t} ||grad_logits log pi(y_j)||^2`` (`token_energy`, summed over the valid tokens
    so far) stands in for the squared norm of the path's gradient. Per group of rows sharing ``index``::

        G_t = sum_{j>=t} r_j                       (valid tokens only)
        b_t = sum_i G_t^i W_t^i m_t^i / (sum_i W_t^i m_t^i + epsilon)
        A_t = (G_t - b_t) * m_t

    Rows that already ended at t (``m_t = 0``) are not in the sums. A one-row group has baseline 0
    (advantage = return). ``rollout_is_weights`` ``[B, T]`` (rollout correction's truncated IS weights)
    scale each token's energy by their square, the variance-optimal choice under truncated IS. Returns
    ``(advantages, returns)``, both 0 on padding.
    """
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(
            "adv_estimator 'optimal_token_baseline' needs old_log_probs and sum_pi_squared [B, T]; the "
            "trainer computes both in the actor's old-log-prob pass (not with "
            "algorithm.rollout_correction.bypass_mode=true, which skips that pass)"
        )
    dtype = _compute_dtype(token_level_rewards)
    mask = response_mask.to(dtype)  # [B, T]
    rewards = torch.where(mask != 0, token_level_rewards.to(dtype), torch.zeros_like(mask))  # [B, T]
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask  # [B, T]
    energy = token_energy(old_log_probs, sum_pi_squared).to(dtype)  # [B, T]
    if rollout_is_weights is not None:
        energy = energy * rollout_is_weights.to(dtype) ** 2  # [B, T]
    # where(): a NaN at a padded slot (Σπ² is not computed there) must not reach the running sum.
    cum_energy = torch.where(mask != 0, energy, torch.zeros_like(energy)).cumsum(-1) * mask  # [B, T]
    inv, num_groups = _group_inverse(index, rewards.shape[0], rewards.device)  # [B]
    shape = (num_groups, rewards.shape[1])
    num = torch.zeros(shape, dtype=dtype, device=rewards.device).index_add_(0, inv, returns * cum_energy)
    den = torch.zeros(shape, dtype=dtype, device=rewards.device).index_add_(0, inv, cum_energy)  # [G, T]
    baseline = (num / (den + epsilon))[inv]  # [B, T]
    count = torch.bincount(inv, minlength=num_groups)[inv]  # [B]
    baseline = torch.where((count > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))  # [B, T]
    advantages = (returns - baseline) * mask  # [B, T]
    return advantages, returns


@register_adv_estimator("tir_optimal_token_baseline", needs_sum_pi_squared=True)
@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for multi-turn (tool-integrated reasoning) trajectories.

    Reference: verl's ``tir_optimal_token_baseline`` estimator, the multi-turn form of the Optimal Token
    Baseline ("Optimal Token Baseline", R. Li, https://richardli.xyz/optimal-token-baseline). In a
    multi-turn response the tool / environment observations sit between the sampled turns with
    ``response_mask`` 0, so the k-th *sampled* token of two trajectories of a group lands in different
    columns. This estimator aligns the group on the sampled-token count instead of the column: with
    ``k(t)`` the number of sampled tokens of the row before column t, ``G``, ``W`` as in
    `compute_optimal_token_baseline_advantage` (rewards and energies of sampled tokens only)::

        b_k = sum_i G_k^i W_k^i / (sum_i W_k^i + epsilon)      (i over the rows with a k-th sampled token)
        A_t = (G_t - b_{k(t)}) * m_t

    On single-turn rows (sampled tokens contiguous) the alignment is the column one. Two more rules: a
    row with no sampled token is left out of its group (a group of one row left has baseline 0:
    advantage = return), and when one row of a group is strictly the longest, its sampled tokens past
    the second-longest row's count get baseline 0 (the baseline there would be its own return, leaving
    it no signal). ``rollout_is_weights`` scale each energy by their square, as in the single-turn form.
    Returns ``(advantages, returns)``, 0 where ``response_mask`` is 0.
    """
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(
            "adv_estimator 'tir_optimal_token_baseline' needs old_log_probs and sum_pi_squared [B, T]; the "
            "trainer computes both in the actor's old-log-prob pass (not with "
            "algorithm.rollout_correction.bypass_mode=true, which skips that pass)"
        )
    dtype = _compute_dtype(token_level_rewards)
    mask = response_mask.to(dtype)  # [B, T]
    sampled = mask != 0  # [B, T]
    rewards = torch.where(sampled, token_level_rewards.to(dtype), torch.zeros_like(mask))  # [B, T]
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask  # [B, T]
    energy = token_energy(old_log_probs, sum_pi_squared).to(dtype)  # [B, T]
    if rollout_is_weights is not None:
        energy = energy * rollout_is_weights.to(dtype) ** 2  # [B, T]
    cum_energy = torch.where(sampled, energy, torch.zeros_like(energy)).cumsum(-1) * mask  # [B, T]
    # Compact each row's sampled tokens to the left: slot k holds its k-th sampled token.
    lengths = sampled.sum(-1)  # [B]
    width = int(lengths.max()) if lengths.numel() else 0
    rows, cols = sampled.nonzero(as_tuple=True)  # [M] each
    slots = (sampled.cumsum(-1) - 1)[rows, cols]  # [M]
    compact_g = mask.new_zeros(mask.shape[0], width).index_put_((rows, slots), returns[rows, cols])  # [B, K]
    compact_w = mask.new_zeros(mask.shape[0], width).index_put_((rows, slots), cum_energy[rows, cols])
    inv, num_groups = _group_inverse(index, rewards.shape[0], rewards.device)  # [B]
    shape = (num_groups, width)
    num = torch.zeros(shape, dtype=dtype, device=mask.device).index_add_(0, inv, compact_g * compact_w)
    den = torch.zeros(shape, dtype=dtype, device=mask.device).index_add_(0, inv, compact_w)  # [G, K]
    baseline = (num / (den + epsilon))[inv]  # [B, K]
    present = lengths > 0  # [B] rows with a sampled token
    members = torch.bincount(inv, weights=present.to(dtype), minlength=num_groups)  # [G]
    baseline = torch.where((members[inv] > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    for group in range(num_groups):  # a strictly longest row: no baseline past the second-longest
        in_group = (inv == group).nonzero(as_tuple=True)[0]
        if int(members[group]) < 2:
            continue
        group_lengths = lengths[in_group]
        top2 = torch.topk(group_lengths, 2).values
        if int(top2[0]) > int(top2[1]):
            longest = in_group[int(torch.argmax(group_lengths))]
            baseline[longest, int(top2[1]) :] = 0.0
    compact_adv = compact_g - baseline  # [B, K]
    advantages = torch.zeros_like(mask)
    advantages[rows, cols] = compact_adv[rows, slots]  # back to the sampled tokens' columns
    return advantages * mask, returns
