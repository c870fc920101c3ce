"""Rollout correction (algorithm.rollout_correction.*): IS weights and rejection, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl.algorithms.rollout_correction import (
    correct_advantages,
    is_weights,
    parse_rs_threshold,
    rejection_keep,
)

TOL = 1e-6  # float32, O(1) values

# Two responses: row 0 has 3 valid tokens, row 1 has 2 (one padding slot).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLLOUT = torch.zeros(2, 3)
# log(pi_old / pi_rollout) per token: row 0: log 1.5, log 3, log 0.5; row 1: log 1.2, log 1.25.
OLD = torch.log(torch.tensor([[1.5, 3.0, 0.5], [1.2, 1.25, 7.0]]))


def test_token_is_weights_are_truncated_ratios():
    w = is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    assert torch.allclose(w, torch.tensor([[1.5, 2.0, 0.5], [1.2, 1.25, 0.0]]), atol=TOL)


def test_sequence_is_weights_are_truncated_products():
    w = is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=2.0)
    # row 0: 1.5 * 3 * 0.5 = 2.25 -> 2.0; row 1: 1.2 * 1.25 = 1.5 (padding ignored).
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 2.0], [1.5, 1.5, 0.0]]), atol=TOL)
    normed = is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=2.0, batch_normalize=True)
    assert torch.allclose(normed, w / 1.75, atol=TOL)  # mean over the 2 sequences = 1.75


def test_rejection_by_token_sequence_and_geometric_mean():
    lower, upper = parse_rs_threshold(2.0)
    assert (lower, upper) == (0.5, 2.0) and parse_rs_threshold("0.8_1.3") == (0.8, 1.3)
    token = rejection_keep(OLD, ROLLOUT, MASK, level="token", lower=0.8, upper=1.3)
    assert torch.equal(token, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    seq = rejection_keep(OLD, ROLLOUT, MASK, level="sequence", lower=0.5, upper=2.0)
    assert torch.equal(seq, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))  # 2.25 > 2
    # geometric means: row 0 2.25 ** (1/3) = 1.31, row 1 1.5 ** (1/2) = 1.22
    geo = rejection_keep(OLD, ROLLOUT, MASK, level="geometric", lower=0.5, upper=1.25)
    assert torch.equal(geo, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert 2.25 ** (1 / 3) > 1.25 > math.sqrt(1.5)


def test_correct_advantages_multiplies_weights_and_keep():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 5.0]])
    cfg = {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": False,
        "rollout_rs": "sequence",
        "rollout_rs_threshold": 2.0,
    }
    out, metrics = correct_advantages(adv, OLD, ROLLOUT, MASK, cfg)
    # row 0 rejected (product 2.25 > 2); row 1 weighted 1.2, 1.25; padding 0.
    assert torch.allclose(out, torch.tensor([[0.0, 0.0, 0.0], [-2.4, -2.5, 0.0]]), atol=TOL)
    assert metrics["rollout_corr/rejected_token_frac"] == pytest.approx(3 / 5)
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx((1.5 + 2.0 + 0.5 + 1.2 + 1.25) / 5)


def test_weighting_advantages_equals_weighting_the_ppo_loss():
    # Every built-in loss is linear in a positive factor on A: vanilla PPO with dual-clip checked here.
    from fusedrl.algorithms import get_policy_loss

    lp = torch.tensor([[0.3, -0.4, 0.1]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    w = torch.tensor([[0.5, 1.5, 2.0]])
    mask = torch.ones(1, 3)
    fn = get_policy_loss("vanilla")
    weighted, _ = fn(lp, old, adv * w, mask, loss_agg_mode="token-mean")
    per_token = []
    for t in range(3):
        one = torch.zeros(1, 3)
        one[0, t] = 1.0
        loss_t, _ = fn(lp, old, adv, one, loss_agg_mode="token-mean")  # the token's own loss
        per_token.append(float(loss_t) * float(w[0, t]))
    assert float(weighted) == pytest.approx(sum(per_token) / 3, abs=TOL)
