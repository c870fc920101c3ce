"""KL penalty in the reward: token rewards minus ``beta * KL(pi || pi_ref)``, with a fixed or adaptive beta.

Used when ``algorithm.use_kl_in_reward=true`` (the InstructGPT-style formulation, as opposed to the KL
*loss* of ``actor.use_kl_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusedrl.algorithms.kl import kl_penalty
from fusedrl.algorithms.utils import masked_mean


@dataclass
class FixedKLController:
    """A constant coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


@dataclass
class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target_kl``.

    Paper: "Fine-Tuning Language Models from Human Preferences" (Ziegler et al., arXiv 1909.08593),
    section 2.2: ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
    The clip keeps one noisy batch from moving beta by more than 20% of the horizon's worth.
    """

    value: float
    target_kl: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS = ("fixed", "adaptive")  # algorithm.kl_ctrl.type


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
):
    """From ``algorithm.kl_ctrl.{type,kl_coef,target_kl,horizon}``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if not target_kl or not horizon:
            raise ValueError(
                "algorithm.kl_ctrl.type=adaptive needs kl_ctrl.target_kl > 0 and kl_ctrl.horizon > 0"
            )
        return AdaptiveKLController(kl_coef, float(target_kl), int(horizon))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r}: use {' or '.join(KL_CONTROLLERS)}")


@torch.no_grad()
def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    beta: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, float]:
    """``rewards = scores - beta * kl`` per token. Returns ``(token_level_rewards [B, T], mean KL)``.

    The mean KL is the mean over sequences of the per-sequence mean over valid tokens, the quantity the
    adaptive controller tracks.
    """
    mask = response_mask.to(token_level_scores.dtype)  # [B, T]
    kl = kl_penalty(log_probs, ref_log_probs, kind) * mask  # [B, T]
    rewards = token_level_scores - beta * kl  # [B, T]
    seq_kl = masked_mean(kl, mask, dim=-1)  # [B]
    return rewards, float(seq_kl.mean())


def penalize_rewards(batch: Any, ctrl: Any, kind: str, metrics: dict[str, float]) -> Any:
    """``algorithm.use_kl_in_reward`` on a `RolloutBatch`: ``token_level_rewards`` = scores - beta * KL(actor ||
    ref) (`apply_kl_in_reward`, ``kind``), beta the controller ``ctrl``'s value, which then adapts to the
    batch's mean KL; the penalty and beta into ``metrics``."""
    b = batch
    rewards, mean_kl = apply_kl_in_reward(
        b.token_level_scores, b.old_log_probs, b.ref_log_probs, b.response_mask, beta=ctrl.value, kind=kind
    )
    batch.token_level_rewards = rewards
    metrics["actor/reward_kl_penalty"] = mean_kl
    metrics["actor/reward_kl_penalty_coeff"] = ctrl.value
    # verl's n_steps: the batch's rows (data.train_batch_size x rollout.n), not its prompts.
    ctrl.update(mean_kl, n_steps=batch.num_samples)
    return batch
