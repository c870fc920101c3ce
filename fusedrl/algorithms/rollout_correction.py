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
- ``rollout_rs``: null, or one option or several joined by commas (a token must pass all of them):
  ``token`` | ``sequence`` | ``geometric`` reject (weight 0) tokens / sequences whose ratio (token ratio,
  sequence product, or geometric mean of the token ratios) is outside ``[lower, upper]``. verl's divergence
  options (`RS_DIVERGENCE_OPTIONS`) bound a per-token divergence between ``pi_old`` and ``pi_rollout``, with
  ``d = log pi_old - log pi_rollout``: ``k1 = -d`` (kept in ``[log lower, log upper]``), ``k2 = d^2 / 2``,
  ``k3 = exp(d) - 1 - d`` (kept at most ``upper``); ``token_*`` per token, ``seq_sum_*`` / ``seq_mean_*`` /
  ``seq_max_*`` on the sum / mean / maximum over the sequence's valid tokens (the whole sequence is kept or
  rejected). ``rollout_rs_threshold``: one value for every option or one per option, comma-separated;
  ``upper`` (lower = 1 / upper) or ``"lower_upper"`` for the ratio bands and ``*_k1``, a single upper bound
  for ``*_k2`` / ``*_k3``.
- ``bypass_mode``: use the rollout's log-probs as ``pi_old`` (no trainer forward for them); the PPO
  ratio then corrects the mismatch itself. The rejection (and, with ``loss_type=reinforce``, the IS
  weights) are then computed in the actor's loss from the *current* log-probs against the rollout's
  (`bypass_correction`), as verl does.
- ``loss_type``: ``ppo_clip`` (the configured policy loss) or ``reinforce`` (bypass mode only):
  ``-w * A * log pi`` with ``w`` the truncated IS weight of ``pi / pi_rollout`` (detached; 1 without
  ``rollout_is``), no ratio clipping (`reinforce_policy_loss`).

The weights multiply the advantages before the actor update. Every built-in loss is linear in a positive
per-token factor on ``A`` (PPO's clip and dual-clip included), so this equals weighting the per-token
policy loss; a rejected token then adds 0 to the loss but still counts in a ``token-mean`` denominator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from fusedrl.algorithms.utils import masked_mean

_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: keeps a product of many token ratios finite

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")  # ratio bands
RS_DIVERGENCE_OPTIONS = (  # verl's divergence bounds (no seq_max_k1: a maximum of a signed k1 bounds nothing)
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
RS_OPTIONS = RS_LEVELS + RS_DIVERGENCE_OPTIONS
LOSS_TYPES = ("ppo_clip", "reinforce")


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


def parse_rs_options(rollout_rs: str) -> list[str]:
    """The options of ``rollout_rs`` (comma-separated, each once, in order); ValueError for an unknown one."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(
            f"rollout_rs={rollout_rs!r}: unknown option(s) {unknown}; use {', '.join(RS_OPTIONS)}"
        )
    return options


def parse_rs_thresholds(options: list[str], spec: float | str | None) -> list[tuple[float, float]]:
    """``(lower, upper)`` per option from ``rollout_rs_threshold``: one entry shared by all options or one per
    option, comma-separated. Ratio bands and ``*_k1``: ``u`` (lower ``1/u``) or ``"l_u"``; ``*_k2`` /
    ``*_k3``: one upper bound > 0 (lower is then unused, 0)."""
    if spec is None or isinstance(spec, bool):
        raise ValueError(f"rollout_rs_threshold={spec!r}: rollout_rs needs a threshold")
    specs = [part.strip() for part in str(spec).split(",") if part.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold={spec!r}: give one threshold for all {len(options)} rollout_rs options "
            "or one per option"
        )
    out: list[tuple[float, float]] = []
    for option, one in zip(options, specs):
        if option.endswith(("_k2", "_k3")):
            if "_" in one or float(one) <= 0:
                raise ValueError(f"rollout_rs_threshold for {option}: {one!r}; give one upper bound > 0")
            out.append((0.0, float(one)))
        else:
            low, high = parse_rs_threshold(one)
            if option.endswith("_k1") and low <= 0:
                raise ValueError(f"rollout_rs_threshold for {option}: {one!r}; the lower bound must be > 0")
            out.append((low, high))
    return out


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


@torch.no_grad()
def divergence_keep(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    option: str,
    lower: float,
    upper: float,
) -> torch.Tensor:
    """``[B, T]`` float, 1 where a token passes the divergence bound ``option`` (`RS_DIVERGENCE_OPTIONS`), 0
    where it or its sequence fails, and on padding. ``d = log pi_old - log pi_rollout`` (clamped to +-20)."""
    maskf = mask.to(torch.float32)  # [B, T]
    d = ((old_log_probs.float() - rollout_log_probs.float()) * maskf).clamp(-_LOG_CLAMP, _LOG_CLAMP)  # [B, T]
    scope, _, kind = option.rpartition("_")
    if kind == "k1":
        div = -d  # [B, T]: log(pi_rollout / pi_old)
    elif kind == "k2":
        div = 0.5 * d * d  # [B, T]
    elif kind == "k3":
        div = torch.exp(d) - 1.0 - d  # [B, T]
    else:
        raise ValueError(
            f"rollout_rs={option!r}: not a divergence option ({', '.join(RS_DIVERGENCE_OPTIONS)})"
        )
    if scope == "token":
        stat = div  # [B, T]
    elif scope == "seq_sum":
        stat = (div * maskf).sum(-1, keepdim=True)  # [B, 1]
    elif scope == "seq_mean":
        stat = (div * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp_min(1.0)  # [B, 1]
    elif scope == "seq_max" and kind != "k1":
        stat = div.masked_fill(maskf == 0, float("-inf")).amax(-1, keepdim=True)  # [B, 1]
        stat = torch.where(torch.isinf(stat), torch.zeros_like(stat), stat)  # an empty row: 0
    else:
        raise ValueError(
            f"rollout_rs={option!r}: not a divergence option ({', '.join(RS_DIVERGENCE_OPTIONS)})"
        )
    if kind == "k1":
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))  # [B, T] or [B, 1]
    else:
        keep = stat <= upper  # [B, T] or [B, 1]
    return keep.expand_as(maskf).to(torch.float32) * maskf  # [B, T]


@torch.no_grad()
def rejection_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    rollout_rs: str,
    rollout_rs_threshold: float | str | None,
) -> torch.Tensor:
    """``[B, T]`` float: 1 where a token passes every option of ``rollout_rs`` (``algorithm.rollout_correction``
    values, comma-separated), 0 where any rejects it, and on padding."""
    options = parse_rs_options(rollout_rs)
    keep = mask.to(torch.float32)  # [B, T]
    for option, (lower, upper) in zip(options, parse_rs_thresholds(options, rollout_rs_threshold)):
        if option in RS_LEVELS:
            one = rejection_keep(
                old_log_probs, rollout_log_probs, mask, level=option, lower=lower, upper=upper
            )
        else:
            one = divergence_keep(
                old_log_probs, rollout_log_probs, mask, option=option, lower=lower, upper=upper
            )
        keep = keep * one  # [B, T]
    return keep


@torch.no_grad()
def correction_factor(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cfg: dict,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``[B, T]`` float factor on the advantages: the response mask times the IS weights and the rejection mask
    that ``cfg`` (``algorithm.rollout_correction``) asks for; and their metrics (``rollout_corr/*``, 0-d
    tensors, each a mean over the valid tokens of these rows). Every quantity is per row, except
    ``rollout_is_batch_normalize``'s mean (over these rows): so the factor of a few whole rows, without that
    key, is the factor those rows get in the whole batch (the actor's in-update correction relies on it)."""
    maskf = mask.to(torch.float32)  # [B, T]
    factor = maskf  # [B, T]
    metrics: dict[str, torch.Tensor] = {}
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
        metrics["rollout_corr/is_weight_mean"] = masked_mean(w, maskf)  # []
    if cfg["rollout_rs"] is not None:
        keep = rejection_mask(
            old_log_probs, rollout_log_probs, mask, str(cfg["rollout_rs"]), cfg["rollout_rs_threshold"]
        )  # [B, T]
        factor = factor * keep
        metrics["rollout_corr/rejected_token_frac"] = 1.0 - keep.sum() / maskf.sum().clamp_min(1.0)  # []
    return factor, metrics


def correct_advantages(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cfg: dict,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``advantages`` times `correction_factor` (the IS weights and the rejection mask that ``cfg``,
    ``algorithm.rollout_correction``, asks for), and their metrics (``rollout_corr/*``)."""
    factor, metrics = correction_factor(old_log_probs, rollout_log_probs, mask, cfg)  # [B, T]
    return advantages * factor, {k: float(v) for k, v in metrics.items()}


@torch.no_grad()
def correct_batch(batch: Any, rc: Any, metrics: dict[str, float]) -> Any:
    """``rc`` (the typed ``algorithm.rollout_correction``) applied to a `RolloutBatch`'s advantages
    (`correct_advantages`), its metrics into ``metrics``; a no-op when both are off, and in bypass mode."""
    if rc.bypass_mode or (rc.rollout_is is None and rc.rollout_rs is None):
        return batch
    if batch.old_log_probs is None:  # the update's forward gives them: the actor's loss corrects
        return batch  # (`in_update_correction`; the driver applies the same factor after the update)
    b = batch
    b.advantages, rc_metrics = correct_advantages(
        b.advantages, b.old_log_probs, b.rollout_log_probs, b.response_mask, dataclasses.asdict(rc)
    )
    metrics.update(rc_metrics)
    return batch


def in_update_correction(
    rc: Any, mb: Any, forward_log_probs: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The advantages ``[b, T]`` the loss takes for micro-batch ``mb`` (a `RolloutBatch`), and ``rollout_corr/*``
    metrics. When the update's own forward gives the old log-probs (``mb.old_log_probs`` is None: the batch is
    used once, in one optimizer step; `trainer.step_plan.old_log_probs_reusable`), the driver could not
    correct the advantages before the update (`correct_batch` skips them); this does it here with
    `correction_factor` of ``forward_log_probs`` (detached: the old policy) against ``mb.rollout_log_probs``,
    the same factor the driver would have applied (per row: the step plan keeps the batch-wide
    ``rollout_is_batch_normalize`` on the separate pass). ``rc``: the typed
    ``algorithm.rollout_correction`` when on and not in bypass mode, else None (the advantages as they are).
    The metrics are means over the micro-batch's valid tokens; weighted by its token share and summed over
    micro-batches and ranks they are the whole batch's (as `correct_advantages` reports them)."""
    if rc is None or mb.old_log_probs is not None or (rc.rollout_is is None and rc.rollout_rs is None):
        return mb.advantages, {}
    if rc.rollout_is_batch_normalize:
        raise ValueError(
            "rollout_is_batch_normalize needs the whole batch's IS weights: compute old_log_probs first"
        )
    if mb.rollout_log_probs is None:
        raise ValueError("rollout correction in the update needs the batch's rollout_log_probs")
    factor, metrics = correction_factor(
        forward_log_probs.detach(), mb.rollout_log_probs, mb.response_mask, dataclasses.asdict(rc)
    )  # [b, T]
    return mb.advantages * factor, metrics


def bypass_correction(
    log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None,
    rollout_is_threshold: float,
    rollout_is_batch_normalize: bool,
    rollout_rs: str | None,
    rollout_rs_threshold: float | str | None,
    loss_type: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bypass mode's correction inside the loss (``algorithm.rollout_correction.bypass_mode=true``): there
    ``pi_old`` is the rollout policy, so the mismatch is measured between the *current* policy ``log_prob``
    (detached) and ``rollout_log_probs``, per micro-batch, as verl does.

    Returns ``(loss_mask [B, T], weights [B, T] or None)``: ``mask`` with the tokens ``rollout_rs`` rejects set to
    0, and for ``loss_type=reinforce`` with ``rollout_is`` the truncated IS weights of ``pi / pi_rollout``
    (``rollout_is_batch_normalize`` rescales them over this micro-batch). PPO-clip takes no weights: its ratio
    ``pi / pi_rollout`` is already the importance ratio.
    """
    current = log_prob.detach()  # [B, T]
    keep = mask.to(torch.float32)  # [B, T]
    if rollout_rs is not None:
        keep = rejection_mask(current, rollout_log_probs, mask, rollout_rs, rollout_rs_threshold)  # [B, T]
    weights = None
    if loss_type == "reinforce" and rollout_is is not None:
        weights = is_weights(
            current,
            rollout_log_probs,
            mask,
            level=rollout_is,
            threshold=float(rollout_is_threshold),
            batch_normalize=rollout_is_batch_normalize,
        )  # [B, T]
    return keep, weights


def reinforce_policy_loss(
    log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    weights: torch.Tensor | None,
    loss_agg_mode: str,
    global_norm: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_type=reinforce`` (bypass mode): the policy gradient ``-w * A * log pi`` per token, aggregated over
    ``response_mask`` (the rejection already applied) by ``loss_agg_mode``. ``w`` (detached truncated IS
    weights of ``pi / pi_rollout``; 1 where None) reweights the rollout's samples towards the current policy.
    No ratio and no clipping. ``ppo_kl``: masked mean of ``log pi_rollout - log pi``; the clip fractions are 0.
    Paper: the off-policy correction of "When Speed Kills Stability" (Liu, Li et al., 2025); REINFORCE:
    Williams, "Simple statistical gradient-following algorithms" (1992)."""
    from fusedrl.algorithms.losses import _ratio_metrics, _upcast, agg_loss

    log_prob, rollout_log_probs, advantages = _upcast(log_prob, rollout_log_probs, advantages)  # [B, T] each
    mask = response_mask.to(log_prob.dtype)  # [B, T]
    loss = -advantages * log_prob  # [B, T]
    if weights is not None:
        loss = loss * weights.to(log_prob.dtype)  # [B, T]
    none = torch.zeros_like(mask, dtype=torch.bool)  # [B, T]
    pg_loss = agg_loss(loss, mask, loss_agg_mode, global_norm)  # []
    return pg_loss, _ratio_metrics(rollout_log_probs - log_prob, none, none, mask)
