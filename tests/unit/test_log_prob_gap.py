"""The rollout-vs-actor log-prob gap as numbers (`fusedrl.log_prob_gap`): the exactly rounded mean and the max
of |rollout - old| on the response mask, the same whatever the split of the rows into shards."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from fusedrl.log_prob_gap import gap_metrics, gap_stats

MEAN, MAX = "rollout/log_prob_abs_diff_mean", "rollout/log_prob_abs_diff_max"


def _data(rows: int = 12, width: int = 30, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=g) * 5
    old = rollout + torch.randn(rows, width, generator=g) * torch.logspace(-9, 1, width)  # every scale
    mask = (torch.rand(rows, width, generator=g) > 0.3).long()
    return rollout, old, mask


def test_the_mean_is_the_exact_mean_rounded_once_and_the_max_the_max():
    rollout, old, mask = _data()
    old[0, 0] = rollout[0, 0] + 1e-42  # a subnormal difference (float32)
    mask[0, 0] = 1
    got = gap_metrics([gap_stats(rollout, old, mask)])
    diff = (rollout - old).abs()[mask.bool()]
    exact = sum(Fraction(v) for v in diff.tolist()) / diff.numel()
    assert got[MEAN] == float(exact) and got[MAX] == float(diff.max())
    assert math.isclose(got[MEAN], float(diff.mean()), rel_tol=1e-6)  # the float32 mean's, to its rounding


def test_any_split_of_the_rows_gives_the_same_floats():
    rollout, old, mask = _data(rows=13, seed=1)
    whole = gap_metrics([gap_stats(rollout, old, mask)])
    for cut in ([5, 8], [1, 1, 11], [4, 4, 4, 1]):
        parts = zip(rollout.split(cut), old.split(cut), mask.split(cut))
        assert gap_metrics([gap_stats(*p) for p in reversed(list(parts))]) == whole, cut


def test_no_token_nan_and_inf():
    rollout, old, mask = _data(rows=4)
    assert gap_metrics([gap_stats(rollout, old, torch.zeros_like(mask))]) == {MEAN: 0.0, MAX: 0.0}
    nan = old.clone()
    nan[mask.bool()] = float("nan")
    parts = [gap_stats(rollout, old, mask), gap_stats(rollout, nan, mask)]
    assert all(math.isnan(v) for v in gap_metrics(parts).values())  # garbage weights trip the health check
    inf = old.clone()
    inf[0][mask[0].bool()] = float("-inf")
    got = gap_metrics([gap_stats(rollout, inf, mask)])
    assert got[MEAN] == math.inf and got[MAX] == math.inf
