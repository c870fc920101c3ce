"""Per-token KL estimators between the current policy and a frozen reference, plus token entropy.

The trainer only has the log-probabilities of the *sampled* tokens, so the KL divergence has to be
estimated from one sample per position; the kinds below trade bias against variance differently.
"""

from __future__ import annotations

import torch

KL_KIND_KEY = "actor_rollout_ref.actor.kl_loss_type"

# exp() of more than ~88 overflows float32; +/-20 already means a probability ratio of ~5e8.
_LOG_RATIO_CLAMP = 20.0
# A single pathological token should not be able to dominate the penalty of a whole batch.
_K3_CLAMP = 10.0

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

__all__ = ["KL_KINDS", "KL_KIND_KEY", "entropy_from_logits", "kl_penalty"]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise estimate of KL(pi || pi_ref) at each sampled token, same shape as the inputs.

    Reference: J. Schulman, "Approximating KL Divergence" (blog post, 2020,
    http://joschu.net/blog/kl-approx.html); no arXiv id.
    With ``x ~ pi`` and ``d = log pi_ref(x) - log pi(x)``:

    - ``"k1"`` / ``"kl"``: ``-d`` -- unbiased, high variance, can be negative per token.
    - ``"abs"``: ``|d|`` -- always non-negative, biased.
    - ``"k2"`` / ``"mse"``: ``d^2 / 2`` -- low variance, biased, gradient is that of a true f-divergence.
    - ``"k3"`` / ``"low_var_kl"``: ``exp(d) - d - 1`` -- unbiased and always >= 0, low variance.
      ``d`` is clamped to [-20, 20] before ``exp`` and the result to [-10, 10] so one extreme token
      cannot produce inf.

    Unknown ``kind`` raises ValueError naming the config key ``actor_rollout_ref.actor.kl_loss_type``.
    """
    if kind in ("k1", "kl"):
        return log_prob - ref_log_prob  # [B, T]
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()  # [B, T]
    if kind in ("k2", "mse"):
        return 0.5 * (log_prob - ref_log_prob).square()  # [B, T]
    if kind in ("k3", "low_var_kl"):
        log_ratio = (ref_log_prob - log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
        kl = torch.exp(log_ratio) - log_ratio - 1.0  # [B, T]
        return kl.clamp(-_K3_CLAMP, _K3_CLAMP)  # [B, T]
    raise ValueError(
        f"Unknown KL estimator {kind!r} (config key `{KL_KIND_KEY}`); choose one of {list(KL_KINDS)}"
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last (vocabulary) axis: ``[..., V] -> [...]``.

    No paper: uses ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` on max-centred logits, which
    never takes the log of a probability that underflowed to 0 (the naive ``-sum p log p`` gives NaN
    there). The caller chooses the precision: pass float32 logits when bf16 rounding of the result
    matters. Logits must be finite (a ``-inf`` logit gives ``0 * -inf = NaN`` in the expectation term).
    """
    # Entropy is shift-invariant; centring on the max first avoids the cancellation of two large,
    # nearly equal terms (logits ~1e4 would otherwise lose ~1e-3 of absolute precision in fp32).
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # [..., V]
    log_norm = torch.logsumexp(shifted, dim=-1)  # [...]
    probs = torch.softmax(shifted, dim=-1)  # [..., V]
    return log_norm - (probs * shifted).sum(dim=-1)  # [...]
