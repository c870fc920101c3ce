"""Policy losses and an estimator added for verl parity: GPG, CISPO, GMPO (``geo_mean``).

Same call shape as `fusedrl.algorithms.losses` (see `register_policy_loss`). A loss whose paper fixes
the aggregation sets ``agg_mode`` on the function; the actor then normalises the policy term (and its
micro-batch bookkeeping) with that mode, while the entropy and KL terms keep ``loss_agg_mode``, as verl does.
"""

from __future__ import annotations

from typing import Any

import torch

from fusedrl.algorithms.advantages import (
    GroupIndex,
    _compute_dtype,
    _group_inverse,
    _group_mean_std,
    _outcome_scores,
)
from fusedrl.algorithms.losses import _LOG_RATIO_CLAMP, _ratio_metrics, _upcast, agg_loss
from fusedrl.algorithms.registry import register_adv_estimator, register_policy_loss
from fusedrl.algorithms.utils import masked_mean


@register_policy_loss("gpg")
def gpg_policy_loss(
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
    """GPG: the plain policy gradient ``-A * log pi``, no ratio and no clipping.

    Paper: "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
    (arXiv 2504.02546). Pair it with ``algorithm.adv_estimator=gpg``. The clip arguments are accepted
    for a uniform call shape and unused; ``ppo_kl`` is still reported.
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    loss = -advantages * log_prob  # [B, T]
    none = torch.zeros_like(mask, dtype=torch.bool)  # [B, T]
    pg_loss = agg_loss(loss, mask, loss_agg_mode, global_norm)  # []
    return pg_loss, _ratio_metrics(old_log_prob - log_prob, none, none, mask)


@register_policy_loss("cispo")
def cispo_policy_loss(
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
    """CISPO: clip the importance weight, not the update; every token keeps a gradient.

    Paper: "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
    (arXiv 2506.13585). Loss per token: ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi`` with
    ``r = exp(log pi - log pi_old)``; ``sg`` stops the gradient, so the token's gradient is its
    REINFORCE term scaled by the clipped weight (PPO instead zeroes clipped tokens' gradients).
    ``pg_clipfrac``: share of valid tokens whose weight was clipped.
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()  # [B, T]
    loss = -weight * advantages * log_prob  # [B, T]
    clipped = (ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)  # [B, T]
    none = torch.zeros_like(clipped)  # [B, T]
    pg_loss = agg_loss(loss, mask, loss_agg_mode, global_norm)  # []
    return pg_loss, _ratio_metrics(old_log_prob - log_prob, clipped, none, mask)


@register_policy_loss("geo_mean")
def gmpo_policy_loss(
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
    """GMPO: maximise the *geometric* mean of the token ratios of a sequence, clipped per token in log
    space, instead of their arithmetic mean.

    Paper: "Geometric-Mean Policy Optimization" (arXiv 2507.20673). Per token, ``l_t = log pi - log pi_old``
    is clipped to ``[-low, +high]`` pessimistically: ``sign(A) * min(sign(A) l_t, sign(A) clip(l_t))``.
    Per sequence ``i``: ``rho_i = exp(mean_t l_t)`` and ``A_i = mean_t A_t`` (a sequence-level advantage),
    loss ``-A_i * rho_i``; the batch loss is the mean over sequences. The paper fixes that aggregation,
    so ``agg_mode`` is ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says: each valid token carries
    its sequence's loss, whose token mean is the loss itself. No dual-clip (``clip_ratio_c`` unused).
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    log_ratio = log_prob - old_log_prob  # [B, T]
    sign = torch.sign(advantages)  # [B, T]
    clipped_log_ratio = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)  # [B, T]
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)  # [B, T]
    seq_log_ratio = masked_mean(pessimistic, mask, dim=-1)  # [B]
    seq_ratio = torch.exp(seq_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))  # [B]
    seq_adv = masked_mean(advantages, mask, dim=-1)  # [B]
    seq_loss = -seq_adv * seq_ratio  # [B]
    loss = seq_loss.unsqueeze(-1).expand_as(mask)  # [B, T]
    clipped = log_ratio != clipped_log_ratio  # [B, T]
    pg_loss = agg_loss(loss, mask, "seq-mean-token-mean", global_norm)  # []
    metrics = _ratio_metrics(-log_ratio, clipped & (advantages > 0), clipped & (advantages < 0), mask)
    return pg_loss, metrics


gmpo_policy_loss.agg_mode = "seq-mean-token-mean"  # type: ignore[attr-defined]


@register_adv_estimator("gpg")
@torch.no_grad()
def compute_gpg_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    f_norm: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG's group-centred advantage, rescaled by the share of samples with a non-zero score.

    Paper: "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
    (arXiv 2504.02546). ``A_i = alpha * (r_i - mean_group(r)) / f_norm`` with ``alpha = B / M``, ``M`` the
    number of samples in the batch whose score is non-zero (at least 1): when most samples score 0, the
    few informative ones get a larger step. No std division; a one-sample group has mean 0.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    scores = _outcome_scores(token_level_rewards, mask)  # [B]
    inv, num_groups = _group_inverse(index, scores.shape[0], scores.device)  # [B]
    mean, _, _ = _group_mean_std(scores, inv, num_groups)  # [B]
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)  # []
    adv = alpha * (scores - mean) / f_norm  # [B]
    advantages = adv.unsqueeze(-1) * mask  # [B, T]
    return advantages, advantages


@register_policy_loss("sapo")
def sapo_policy_loss(
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
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

    Paper: "Soft Adaptive Policy Optimization" (arXiv 2511.20347). Per token, with ``r = exp(log pi -
    log pi_old)`` and ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``: gate ``f(r) = sigmoid(tau (r - 1))
    * 4 / tau`` and loss ``-f(r) * A``. ``f'(1) = 1``, so near the old policy the gradient is PPO's; far
    from it the gate flattens and the gradient fades smoothly (a larger ``tau_neg`` fades negative updates
    sooner). The paper aggregates per sequence: ``agg_mode = "seq-mean-token-mean"`` (used whatever
    ``loss_agg_mode`` says). ``tau_pos`` / ``tau_neg`` come from ``actor_rollout_ref.actor.tau_pos`` /
    ``tau_neg`` (``config_keys``). The clip arguments are unused; the clip fractions are 0.
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [B, T]
    loss = -gate * advantages  # [B, T]
    none = torch.zeros_like(mask, dtype=torch.bool)  # [B, T]
    pg_loss = agg_loss(loss, mask, "seq-mean-token-mean", global_norm)  # []
    return pg_loss, _ratio_metrics(-log_ratio, none, none, mask)


sapo_policy_loss.agg_mode = "seq-mean-token-mean"  # type: ignore[attr-defined]
sapo_policy_loss.config_keys = ("tau_pos", "tau_neg")  # type: ignore[attr-defined]
