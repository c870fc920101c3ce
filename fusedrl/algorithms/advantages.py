"""Advantage estimators, registered by the name used in ``algorithm.adv_estimator``.

Every estimator has the same call shape so the trainer can pass one uniform set of arguments:

    fn(token_level_rewards [B, T], response_mask [B, T], index (group id per row), **kwargs)
        -> (advantages [B, T], returns [B, T])

``index`` holds one hashable group id per row (usually the prompt uid), so rows sampled from the same
prompt form a group. Arguments an estimator does not use (e.g. ``values`` for GRPO) are ignored.
Outcome rewards are read as the masked sum of ``token_level_rewards`` over the response, so a reward
written at a padded position never counts. A group of a single row has no baseline to compare against:
every group estimator then uses a baseline of 0 (and GRPO a std of 1), i.e. the raw reward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from fusedrl.algorithms.registry import register_adv_estimator
from fusedrl.algorithms.utils import masked_sum, masked_whiten

GroupIndex = np.ndarray | Sequence[Hashable] | torch.Tensor

__all__ = [
    "compute_gae_advantage",
    "compute_gdpo_advantage",
    "compute_grpo_advantage",
    "compute_opo_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_remax_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_rloo_advantage",
    "discounted_returns",
]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Group statistics in bf16 lose the small differences between rewards that carry the signal.
    return torch.promote_types(x.dtype, torch.float32)


def _group_inverse(index: GroupIndex, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to dense ints 0..G-1 (first-seen order)."""
    keys = index.tolist() if isinstance(index, (np.ndarray, torch.Tensor)) else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} group ids but the batch has {batch_size} rows")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(k, len(dense)) for k in keys]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)  # [B]


def _scatter_sum(values: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)  # [G]
    return out.scatter_add_(0, inv, values)  # [G]


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() rather than x * mask: a NaN value or reward at a padded slot must not leak out as NaN.
    return torch.where(mask != 0, x, torch.zeros_like(x))  # [B, T]


def _outcome_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(token_level_rewards)
    return masked_sum(token_level_rewards.to(dtype), mask.to(dtype), dim=-1)  # [B]


def _group_mean_std(scores: torch.Tensor, inv: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, ...]:
    """Per-row group mean, unbiased group std and group size, with singletons set to mean 0, std 1."""
    count = _scatter_sum(torch.ones_like(scores), inv, num_groups)[inv]  # [B]
    mean = _scatter_sum(scores, inv, num_groups)[inv] / count  # [B]
    sq_dev = (scores - mean) ** 2  # [B]
    # Bessel's correction matches torch.std's default; guarded so singleton groups do not divide by 0.
    var = _scatter_sum(sq_dev, inv, num_groups)[inv] / (count - 1).clamp_min(1)  # [B]
    single = count <= 1  # [B]
    mean = torch.where(single, torch.zeros_like(mean), mean)  # [B]
    std = torch.where(single, torch.ones_like(var), var.sqrt())  # [B]
    return mean, std, count


@register_adv_estimator("grpo")
@torch.no_grad()
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage of GRPO, optionally without the std division (Dr. GRPO).

    Papers: "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models"
    (arXiv 2402.03300) for ``(r - mean) / (std + eps)``; "Understanding R1-Zero-Like Training: A
    Critical Perspective" (arXiv 2503.20783) for ``norm_adv_by_std_in_grpo=False``, which drops the
    std because it up-weights prompts that are almost always solved or almost always failed.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    scores = _outcome_scores(token_level_rewards, mask)  # [B]
    inv, num_groups = _group_inverse(index, scores.shape[0], scores.device)  # [B]
    mean, std, _ = _group_mean_std(scores, inv, num_groups)  # [B] each
    centered = scores - mean  # [B]
    adv = centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered  # [B]
    advantages = adv.unsqueeze(-1) * mask  # [B, T]
    return advantages, advantages


@register_adv_estimator("gdpo", needs_reward_components=True)
@torch.no_grad()
def compute_gdpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: normalise each reward component within its group *before* combining them.

    Paper: "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
    Optimization" (arXiv 2601.05242). Summing several rewards first and then applying GRPO lets the
    component with the largest spread decide every advantage, and distinct reward combinations
    collapse onto one value. Here, for each component ``k`` (``reward_components[:, k]`` ``[B]``),
    ``A_k`` is GRPO's group-relative advantage of that component alone (std division as
    ``norm_adv_by_std_in_grpo``); ``A = sum_k w_k A_k`` (``reward_weights``, default all 1) is then
    whitened over all valid tokens of the batch, which keeps its scale independent of the number of
    components. Without ``reward_components`` the one component is the outcome reward of
    ``token_level_rewards`` (GRPO, then batch whitening). ``returns = advantages``.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    if reward_components is None:
        components = _outcome_scores(token_level_rewards, mask).unsqueeze(-1)  # [B, 1]
    else:
        components = reward_components.to(mask.dtype)  # [B, K]
        if components.dim() != 2 or components.shape[0] != mask.shape[0]:
            raise ValueError(
                f"gdpo: reward_components must be [B, K] with B={mask.shape[0]}, got {tuple(components.shape)}"
            )
    num = components.shape[1]
    weights = [1.0] * num if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != num:
        raise ValueError(
            f"gdpo: {len(weights)} reward weights for {num} reward components "
            "(algorithm.gdpo_reward_weights needs one weight per entry of algorithm.gdpo_reward_keys)"
        )
    inv, num_groups = _group_inverse(index, mask.shape[0], mask.device)  # [B]
    combined = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)  # [B]
    for k in range(num):
        scores = components[:, k]  # [B]
        mean, std, _ = _group_mean_std(scores, inv, num_groups)  # [B] each
        centered = scores - mean  # [B]
        adv_k = centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered  # [B]
        combined = combined + weights[k] * adv_k  # [B]
    advantages = _whitened_token_advantages(combined.unsqueeze(-1) * mask, mask)  # [B, T]
    return advantages, advantages


@register_adv_estimator("rloo")
@torch.no_grad()
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: each sample's baseline is the mean reward of the other samples.

    Paper: "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
    in LLMs" (arXiv 2402.14740). For a group of size n > 1,
    ``r_i - mean_{j != i} r_j == (n * r_i - sum_j r_j) / (n - 1)``, which is the form computed here
    because it needs only the group sum. Excluding r_i from its own baseline keeps the estimator unbiased.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    scores = _outcome_scores(token_level_rewards, mask)  # [B]
    inv, num_groups = _group_inverse(index, scores.shape[0], scores.device)  # [B]
    count = _scatter_sum(torch.ones_like(scores), inv, num_groups)[inv]  # [B]
    total = _scatter_sum(scores, inv, num_groups)[inv]  # [B]
    loo = (count * scores - total) / (count - 1).clamp_min(1)  # [B]
    adv = torch.where(count > 1, loo, scores)  # [B]
    advantages = adv.unsqueeze(-1) * mask  # [B, T]
    return advantages, advantages


def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t'}`` where t' is the next *valid* token.

    No paper: the Monte-Carlo return. Masked positions (padding, or tool / environment tokens inside a
    multi-turn response) are skipped rather than discounted through, so inserting masked tokens
    never changes the return seen by the policy's own tokens. Masked positions are returned as 0.
    """
    dtype = _compute_dtype(token_level_rewards)
    mask = response_mask.to(dtype)  # [B, T]
    rewards = token_level_rewards.to(dtype)  # [B, T]
    returns = torch.zeros_like(rewards)  # [B, T]
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        candidate = rewards[:, t] + gamma * running  # [B]
        running = torch.where(mask[:, t] != 0, candidate, running)  # [B]
        returns[:, t] = running  # [B]
    return _zero_masked(returns, mask)  # [B, T]


def _whitened_token_advantages(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Whitening across the whole batch (not per group) is what separates REINFORCE++ from GRPO:
    # the paper argues per-prompt normalisation over-fits easy prompts.
    return _zero_masked(masked_whiten(per_token, mask), mask)  # [B, T]


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    gamma: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted token returns, whitened over all valid tokens of the batch.

    Paper: "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
    (arXiv 2501.03262). ``returns`` are the un-whitened discounted returns.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    returns = discounted_returns(token_level_rewards, mask, gamma)  # [B, T]
    advantages = _whitened_token_advantages(returns, mask)  # [B, T]
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then batch-level whitening.

    Paper: "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
    (arXiv 2501.03262), the variant for several samples per prompt. The group mean removes the
    per-prompt difficulty offset; the batch whitening (instead of GRPO's per-group std) fixes the scale.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    scores = _outcome_scores(token_level_rewards, mask)  # [B]
    inv, num_groups = _group_inverse(index, scores.shape[0], scores.device)  # [B]
    mean, _, _ = _group_mean_std(scores, inv, num_groups)  # [B]
    per_token = (scores - mean).unsqueeze(-1) * mask  # [B, T]
    advantages = _whitened_token_advantages(per_token, mask)  # [B, T]
    return advantages, advantages


@register_adv_estimator("opo")
@torch.no_grad()
def compute_opo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO's optimal baseline: the length-weighted mean reward of the group.

    Paper: "On-Policy RL with Optimal Reward Baseline" (arXiv 2505.23585). Assuming per-token
    gradients are roughly orthogonal with similar norms, ``||grad log pi(y)||^2`` grows with the
    length of y, and the variance-minimising baseline becomes ``sum_j len_j r_j / sum_j len_j``.
    """
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    scores = _outcome_scores(token_level_rewards, mask)  # [B]
    lengths = mask.sum(dim=-1)  # [B]
    inv, num_groups = _group_inverse(index, scores.shape[0], scores.device)  # [B]
    count = _scatter_sum(torch.ones_like(scores), inv, num_groups)[inv]  # [B]
    weighted = _scatter_sum(lengths * scores, inv, num_groups)[inv]  # [B]
    total_len = _scatter_sum(lengths, inv, num_groups)[inv]  # [B]
    # A group whose responses are all empty has no weight; its baseline falls back to 0.
    baseline = weighted / total_len.clamp_min(1e-8)  # [B]
    baseline = torch.where(count > 1, baseline, torch.zeros_like(baseline))  # [B]
    advantages = (scores - baseline).unsqueeze(-1) * mask  # [B, T]
    return advantages, advantages


@register_adv_estimator("gae", needs_critic=True)
@torch.no_grad()
def compute_gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation with a learned critic; advantages are then batch-whitened.

    Paper: "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
    (arXiv 1506.02438). ``A_t = sum_k (gamma * lam)^k delta_{t+k}`` with
    ``delta_t = r_t + gamma * V_{t+1} - V_t``; the value after the last valid token is 0 (the episode
    ends there). Masked positions are skipped, so the next value / advantage is that of the next valid
    token. ``returns = A + V`` (before whitening) is the critic's regression target.
    """
    if values is None:
        raise ValueError(
            "adv_estimator 'gae' needs `values` [B, T] from a critic (set algorithm.adv_estimator "
            "to a critic-free estimator such as 'grpo' when no critic is configured)"
        )
    dtype = _compute_dtype(token_level_rewards)
    mask = response_mask.to(dtype)  # [B, T]
    rewards = token_level_rewards.to(dtype)  # [B, T]
    vals = values.to(dtype)  # [B, T]
    raw_adv = torch.zeros_like(rewards)  # [B, T]
    next_value = torch.zeros_like(rewards[:, 0])  # [B]
    next_adv = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]  # [B]
        adv_t = delta + gamma * lam * next_adv  # [B]
        valid = mask[:, t] != 0  # [B]
        # Only a valid token moves the recursion; a masked one passes its successor's state through.
        next_value = torch.where(valid, vals[:, t], next_value)  # [B]
        next_adv = torch.where(valid, adv_t, next_adv)  # [B]
        raw_adv[:, t] = adv_t  # [B]
    raw_adv = _zero_masked(raw_adv, mask)  # [B, T]
    returns = _zero_masked(raw_adv + vals, mask)  # [B, T]
    advantages = _zero_masked(masked_whiten(raw_adv, mask), mask)  # [B, T]
    return advantages, returns


@register_adv_estimator("remax", needs_greedy_baseline=True)
@torch.no_grad()
def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    reward_baselines: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: REINFORCE with the reward of the *greedy* response to the same prompt as the baseline.

    Paper: "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
    Language Models" (arXiv 2310.10505). The greedy rollout is a cheap, prompt-specific baseline that
    needs no critic and no group of samples. Returns-to-go (gamma = 1) minus the baseline on every token.
    ``reward_baselines`` [B] is filled by the trainer (``PPOTrainer.compute_reward_baselines``).
    """
    if reward_baselines is None:
        raise ValueError(
            "remax needs reward_baselines (the greedy response's reward per row); the trainer computes "
            "them when algorithm.adv_estimator=remax"
        )
    mask = response_mask.to(_compute_dtype(token_level_rewards))  # [B, T]
    rewards = torch.where(mask.bool(), token_level_rewards.to(mask.dtype), torch.zeros_like(mask))  # [B, T]
    returns = rewards.flip(-1).cumsum(-1).flip(-1)  # [B, T], reward-to-go with gamma = 1
    advantages = (returns - reward_baselines.to(mask.dtype).unsqueeze(-1)) * mask  # [B, T]
    return advantages, returns * mask
