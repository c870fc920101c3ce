"""Rollout correction: importance weights and rejection for the rollout / trainer mismatch.

The engine that samples (vLLM, maybe in bf16) and the trainer that computes ``old_log_probs`` (FSDP2) are
two implementations of the same policy; their log-probs differ, so the samples are slightly off-policy for
the trainer's ``pi_old``. Reference: "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch" (Liu, Li et al., 2025, https://richardli.xyz/rl-collapse); truncated
importance sampling as in "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(Yao et al., 2025, https://fengyao.notion.site/off-policy-rl).

Keys (``algorithm.rollout_correction.*``, verl's names):

- ``rollout_is``: ``token`` | ``sequence`` | null. Weight ``w = min(pi_old / pi_rollout, threshold)`` per
  token, or per sequence (the product of its token ratios, broadcast to its tokens), with
  ``threshold = rollout_is_threshold``. ``rollout_is_batch_normalize`` rescales the weights to mean 1.
- ``rollout_rs``: ``token`` | ``sequence`` | ``geometric`` | null. Reject (weight 0) tokens / sequences
  whose ratio (token ratio, sequence product, or geometric mean of the token ratios) is outside
  ``[lower, upper]``; ``rollout_rs_threshold`` is ``upper`` (lower = 1 / upper) or ``"lower_upper"``.
- ``bypass_mode``: use the rollout's log-probs as ``pi_old`` (no trainer forward for them); the PPO
  ratio then corrects the mismatch itself.

The weights multiply the advantages before the actor update. Every built-in loss is linear in a positive
per-token factor on ``A`` (PPO's clip and dual-clip included), so this equals weighting the per-token
policy loss; a rejected token then adds 0 to the loss but still counts in a ``token-mean`` denominator.
"""

from __future__ import annotations

import math

import torch

from fusedrl.algorithms.utils import masked_mean

_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: keeps a product of many token ratios finite

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def parse_rs_threshold(value: float | str) -> tuple[float, float]:
    """``(lower, upper)`` from ``rollout_rs_threshold``: a number ``u`` (-> ``1/u, u``) or ``"l_u"``."""
    if isinstance(value, str) and "_" in value:
        low, high = (float(v) for v in value.split("_", 1))
    else:
        high = float(value)
        low = 1.0 / high
    if not 0 <= low < high:
        raise ValueError(f"rollout_rs_threshold={value!r}: need 0 <= lower < upper")
    return low, high


@torch.no_grad()
def is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Truncated importance weights ``[B, T]`` of ``pi_old / pi_rollout`` (0 on padding)."""
    mask = mask.to(torch.float32)  # [B, T]
    log_ratio = (old_log_probs.float() - rollout_log_probs.float()) * mask  # [B, T]
    if level == "token":
        w = torch.exp(log_ratio.clamp(-_LOG_CLAMP, _LOG_CLAMP)).clamp(max=threshold) * mask  # [B, T]
        mean = masked_mean(w, mask)  # []: over valid tokens
    elif level == "sequence":
        seq_w = torch.exp(log_ratio.sum(-1).clamp(-_LOG_CLAMP, _LOG_CLAMP)).clamp(max=threshold)  # [B]
        rows = (mask.sum(-1) > 0).to(torch.float32)  # [B]
        w = seq_w.unsqueeze(-1) * mask  # [B, T]
        mean = masked_mean(seq_w, rows)  # []: over non-empty sequences
    else:
        raise ValueError(f"rollout_is={level!r}: use token or sequence")
    if batch_normalize:
        w = w / mean.clamp_min(1e-8)  # [B, T]: mean 1 at the level the weights live on
    return w


@torch.no_grad()
def rejection_keep(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    lower: float,
    upper: float,
) -> torch.Tensor:
    """``[B, T]`` float, 1 where a token is kept, 0 where it (or its sequence) is rejected or padding."""
    maskf = mask.to(torch.float32)  # [B, T]
    log_ratio = (old_log_probs.float() - rollout_log_probs.float()) * maskf  # [B, T]
    lo, hi = math.log(max(lower, 1e-30)), math.log(upper)
    if level == "token":
        keep = (log_ratio >= lo) & (log_ratio <= hi)  # [B, T]
    elif level in ("sequence", "geometric"):
        stat = log_ratio.sum(-1)  # [B]: log of the product of token ratios
        if level == "geometric":
            stat = stat / maskf.sum(-1).clamp_min(1.0)  # [B]: log of their geometric mean
        keep = ((stat >= lo) & (stat <= hi)).unsqueeze(-1).expand_as(maskf)  # [B, T]
    else:
        raise ValueError(f"rollout_rs={level!r}: use token, sequence or geometric")
    return keep.to(torch.float32) * maskf


def correct_advantages(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cfg: dict,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``advantages`` times the IS weights and the rejection mask that ``cfg``
    (``algorithm.rollout_correction``) asks for, and their metrics (``rollout_corr/*``)."""
    factor = mask.to(torch.float32)  # [B, T]
    metrics: dict[str, float] = {}
    if cfg["rollout_is"] is not None:
        w = is_weights(
            old_log_probs,
            rollout_log_probs,
            mask,
            level=str(cfg["rollout_is"]),
            threshold=float(cfg["rollout_is_threshold"]),
            batch_normalize=bool(cfg["rollout_is_batch_normalize"]),
        )  # [B, T]
        factor = factor * w
        metrics["rollout_corr/is_weight_mean"] = float(masked_mean(w, mask.to(torch.float32)))
    if cfg["rollout_rs"] is not None:
        lower, upper = parse_rs_threshold(cfg["rollout_rs_threshold"])
        keep = rejection_keep(
            old_log_probs, rollout_log_probs, mask, level=str(cfg["rollout_rs"]), lower=lower, upper=upper
        )  # [B, T]
        factor = factor * keep
        valid = float(mask.sum())
        metrics["rollout_corr/rejected_token_frac"] = 1.0 - float(keep.sum()) / max(valid, 1.0)
    return advantages * factor, metrics
