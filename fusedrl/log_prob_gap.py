"""The rollout-vs-actor log-prob gap of a step (``rollout/log_prob_abs_diff_mean`` / ``_max``) as numbers.

Where the rollout's log-probs and the old log-probs stay on the workers that made them (`fusedrl.resident`),
each worker answers `gap_stats` of its rows (plain ints and floats, no tensor) and the driver adds the
shards' up (`gap_metrics`); where the driver holds both tensors it calls the same two functions. The mean is
the exactly rounded mean of the float32 |differences| over the response mask: each value is a 24-bit
integer times a power of two, added exactly as integers per exponent, so neither the order of the sum nor
the split of the rows over ranks changes a bit of it (the resident and the transfer path give the same
float). A NaN anywhere makes both metrics NaN and an infinite gap makes the mean infinite, as
``tensor.mean()`` / ``max()`` did (the health check ``trainer.rollout_check_tol`` relies on it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MANTISSA_BITS = 24  # float32: |x| = m * 2**e with m < 2**24 an integer, e >= -149 - 24 + 24
_LOWEST = -149 - _MANTISSA_BITS  # the smallest exponent of a float32 subnormal's integer mantissa


@dataclass(frozen=True)
class GapStats:
    """One shard's gap: ``sums`` ``((e, s), ...)``, the finite |differences| add up to ``sum(s * 2**e)``
    exactly; ``count`` tokens (non-finite ones too); ``nan`` / ``inf``: any NaN / infinite difference;
    ``max``: the largest finite or infinite one (0.0 for none)."""

    sums: tuple[tuple[int, int], ...]
    count: int
    nan: bool
    inf: bool
    max: float


def gap_stats(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> GapStats:
    """|rollout - old| (computed as the driver's metric always did, then as float32) on ``mask``'s tokens."""
    diff = (rollout - old).abs()[mask.bool()].to(torch.float32)  # [N valid]
    finite = torch.isfinite(diff)
    mantissa, exponent = torch.frexp(diff[finite])  # diff = mantissa * 2**exponent, 0.5 <= mantissa < 1
    ints = (mantissa * 2**_MANTISSA_BITS).to(torch.int64)  # exact: a power-of-two scaling
    exps = exponent.to(torch.int64) - _MANTISSA_BITS  # [N finite]
    sums: dict[int, int] = {}
    if ints.numel():
        base = int(exps.min())
        per = torch.zeros(int(exps.max()) - base + 1, dtype=torch.int64).index_add_(0, exps - base, ints)
        sums = {base + i: int(s) for i, s in enumerate(per.tolist()) if s}
    nan = bool(torch.isnan(diff).any())
    top = diff[~torch.isnan(diff)]
    return GapStats(
        sums=tuple(sorted(sums.items())),
        count=int(diff.numel()),
        nan=nan,
        inf=bool(torch.isinf(diff).any()),
        max=float(top.max()) if top.numel() else 0.0,
    )


def gap_metrics(parts: Sequence[GapStats]) -> dict[str, float]:
    """``rollout/log_prob_abs_diff_mean`` and ``_max`` of the rows of all ``parts`` (0.0 for no token)."""
    count = sum(p.count for p in parts)
    if count == 0:
        return {"rollout/log_prob_abs_diff_mean": 0.0, "rollout/log_prob_abs_diff_max": 0.0}
    if any(p.nan for p in parts):
        mean = top = math.nan
    else:
        top = max(p.max for p in parts)
        if any(p.inf for p in parts):
            mean = math.inf
        else:  # an exact integer over count * 2**-_LOWEST, divided with one rounding (int / int)
            total = sum(s << (e - _LOWEST) for p in parts for e, s in p.sums)
            mean = total / (count << -_LOWEST)
    return {"rollout/log_prob_abs_diff_mean": mean, "rollout/log_prob_abs_diff_max": top}
