"""Clip-Cov and KL-Cov: policy losses that restrain the few tokens driving entropy collapse.

Paper: "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al., 2025,
arXiv 2505.22617). The change of the policy's entropy in one step follows the covariance, over tokens,
between a token's log-probability and its advantage; a small share of tokens with a large positive
covariance (confident tokens with high advantages) pulls entropy down. Both losses score each valid token
of the micro-batch by ``cov_t = (A_t - mean(A)) * (log pi_t - mean(log pi))`` (means over the valid tokens
of the micro-batch, the log-probs detached) and treat the selected tokens differently:

- ``clip_cov``: PPO's clipped surrogate, and among the tokens PPO did not clip whose ``cov_t`` lies in
  ``(clip_cov_lb, clip_cov_ub)``, ``max(1, int(clip_cov_ratio * valid tokens))`` chosen uniformly at
  random have their gradient removed (their loss is kept as a constant).
- ``kl_cov``: the unclipped surrogate ``-A * r`` on every token, plus ``ppo_kl_coef * |log r|`` on the
  ``max(1, int(kl_cov_ratio * valid tokens))`` tokens with the largest ``cov_t``.

verl's keys: ``actor_rollout_ref.actor.policy_loss.clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``,
``kl_cov_ratio``, ``ppo_kl_coef`` (the functions' ``config_keys``). Clip-Cov's random choice is drawn from
a generator seeded by ``seed``, which the actor derives from ``rollout.seed``, the optimizer's step count
(checkpointed) and the micro-batch's place in the update: a rerun, or a resumed run, picks the same tokens.
"""

from __future__ import annotations

import torch

from fusedrl.algorithms.losses import _LOG_RATIO_CLAMP, _ratio_metrics, _upcast, agg_loss
from fusedrl.algorithms.registry import register_policy_loss
from fusedrl.algorithms.utils import masked_mean

__all__ = ["clip_cov_policy_loss", "kl_cov_policy_loss", "token_covariance"]


def token_covariance(log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` per-token term of the covariance between the (detached) log-prob and the advantage over
    the valid tokens; ``-inf`` on padding so it is never selected."""
    logp = log_prob.detach()  # [B, T]
    cov = (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))  # [B, T]
    return torch.where(mask != 0, cov, torch.full_like(cov, -torch.inf))  # [B, T]


def _selection_size(ratio: float, mask: torch.Tensor, key: str) -> int:
    if ratio <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.{key} must be > 0, got {ratio}")
    return max(int(ratio * int(mask.sum().item())), 1)


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
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
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO's clipped surrogate, with the gradient of a few random high-covariance tokens removed.

    Paper: "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
    (arXiv 2505.22617), see the module docstring. Per token ``L = max(-A r, -A clip(r, 1 - low, 1 + high))``
    (no dual-clip: ``clip_ratio_c`` unused). Candidates: valid tokens on PPO's unclipped branch with
    ``clip_cov_lb < cov_t < clip_cov_ub``; ``max(1, int(clip_cov_ratio * valid))`` of them (or all, if fewer)
    are drawn without replacement by a ``torch.Generator`` seeded with ``seed``, and their ``L`` is
    detached. Metrics: ``pg_clipfrac`` (PPO's clip), ``cov_detached_frac`` (share of valid tokens detached).
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [B, T]
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    clipped = (loss_clipped > loss_unclipped) & (mask != 0)  # [B, T]

    cov = token_covariance(log_prob, advantages, mask)  # [B, T]
    candidates = (~clipped) & (mask != 0) & (cov > clip_cov_lb) & (cov < clip_cov_ub)  # [B, T]
    flat = candidates.flatten().nonzero().squeeze(-1).cpu()  # [C], row-major positions
    want = _selection_size(clip_cov_ratio, mask, "clip_cov_ratio")
    gen = torch.Generator().manual_seed(int(seed))
    chosen = flat[torch.randperm(flat.numel(), generator=gen)[:want]]  # [min(want, C)]
    detach = torch.zeros(candidates.numel(), dtype=torch.bool)  # [B * T]
    detach[chosen] = True
    detach = detach.view_as(candidates).to(candidates.device)  # [B, T]
    loss = torch.where(detach, loss.detach(), loss)  # [B, T]

    pg_loss = agg_loss(loss, mask, loss_agg_mode, global_norm)  # []
    metrics = _ratio_metrics(old_log_prob - log_prob, clipped, torch.zeros_like(clipped), mask)
    metrics["cov_detached_frac"] = masked_mean(detach.to(mask.dtype), mask).detach()  # []
    return pg_loss, metrics


clip_cov_policy_loss.config_keys = (  # type: ignore[attr-defined]
    "policy_loss.clip_cov_ratio",
    "policy_loss.clip_cov_lb",
    "policy_loss.clip_cov_ub",
)
clip_cov_policy_loss.needs_seed = True  # type: ignore[attr-defined]


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
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
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate, with a KL penalty on the tokens of largest covariance.

    Paper: "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
    (arXiv 2505.22617), see the module docstring. Per token ``L = -A r`` with ``r = exp(log pi -
    log pi_old)``; on the ``max(1, int(kl_cov_ratio * valid))`` valid tokens with the largest ``cov_t``
    (``torch.topk``: deterministic) ``L += ppo_kl_coef * |log pi - log pi_old|``. No ratio clipping (the
    clip arguments are unused; the clip fractions are 0). Metric ``kl_cov_frac``: share of valid tokens
    penalised.
    """
    log_prob, old_log_prob, advantages = _upcast(log_prob, old_log_prob, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    loss = -advantages * torch.exp(log_ratio)  # [B, T]
    cov = token_covariance(log_prob, advantages, mask)  # [B, T]
    want = min(_selection_size(kl_cov_ratio, mask, "kl_cov_ratio"), int(mask.sum().item()))
    top = torch.topk(cov.flatten(), want).indices  # [want]
    penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)  # [B * T]
    penalised[top] = True
    penalised = penalised.view_as(cov)  # [B, T]
    loss = loss + torch.where(penalised, ppo_kl_coef * log_ratio.abs(), torch.zeros_like(loss))  # [B, T]

    pg_loss = agg_loss(loss, mask, loss_agg_mode, global_norm)  # []
    none = torch.zeros_like(penalised)  # [B, T]
    metrics = _ratio_metrics(old_log_prob - log_prob, none, none, mask)
    metrics["kl_cov_frac"] = masked_mean(penalised.to(mask.dtype), mask).detach()  # []
    return pg_loss, metrics


kl_cov_policy_loss.config_keys = (  # type: ignore[attr-defined]
    "policy_loss.kl_cov_ratio",
    "policy_loss.ppo_kl_coef",
)
