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


# ----------------------------------------------------------------- verl's divergence rejection options
def _keep(option: str, threshold) -> list:
    from fusedrl.algorithms.rollout_correction import rejection_mask

    return rejection_mask(OLD, ROLLOUT, MASK, option, threshold).tolist()


def test_divergence_rejection_options_by_hand():
    # d = log(pi_old / pi_rollout): row0 log 1.5, log 3, log 0.5; row1 log 1.2, log 1.25 (+ padding)
    # token_k1: k1 = -d = log(pi_rollout / pi_old), kept in [log 0.4, log 2.5] (threshold 2.5 -> lower 1/2.5):
    #   ratios 1/1.5 = 0.67, 1/3 = 0.33 (out), 2; 0.83, 0.8
    assert _keep("token_k1", 2.5) == [[1, 0, 1], [1, 1, 0]]
    # token_k2: d^2 / 2 <= 0.1: 0.082, 0.603 (out), 0.240 (out); 0.017, 0.025
    assert _keep("token_k2", 0.1) == [[1, 0, 0], [1, 1, 0]]
    # token_k3: e^d - 1 - d <= 0.1: 1.5 - 1 - 0.405 = 0.095, 3 - 1 - 1.099 = 0.901 (out), 0.5 - 1 + 0.693 = 0.193
    #   (out); 1.2 - 1 - 0.182 = 0.018, 1.25 - 1 - 0.223 = 0.027
    assert _keep("token_k3", 0.1) == [[1, 0, 0], [1, 1, 0]]
    # seq_max_k2 <= 0.1: row0 max 0.603 -> the whole row out; row1 max 0.025
    assert _keep("seq_max_k2", 0.1) == [[0, 0, 0], [1, 1, 0]]
    # seq_max_k3 <= 0.05: row0 max 0.901 out; row1 max 0.027
    assert _keep("seq_max_k3", 0.05) == [[0, 0, 0], [1, 1, 0]]
    # seq_sum_k3 <= 0.05: row0 0.095 + 0.901 + 0.193 = 1.19 out; row1 0.018 + 0.027 = 0.045
    assert _keep("seq_sum_k3", 0.05) == [[0, 0, 0], [1, 1, 0]]
    # seq_mean_k1 in [log(1/1.3), log 1.3]: row0 mean -log(2.25)/3 -> ratio 2.25^(-1/3) = 0.763 < 0.769 out;
    #   row1 mean -log(1.5)/2 -> 1.5^(-1/2) = 0.816, kept
    assert _keep("seq_mean_k1", 1.3) == [[0, 0, 0], [1, 1, 0]]
    # seq_sum_k1 in [0.4, 2.5]: row0 product of rollout/old = 1 / 2.25 = 0.44 kept; row1 1 / 1.5 = 0.67 kept
    assert _keep("seq_sum_k1", "0.4_2.5") == [[1, 1, 1], [1, 1, 0]]
    # seq_mean_k2 <= 0.1: row0 (0.082 + 0.603 + 0.240) / 3 = 0.308 out; row1 (0.017 + 0.025) / 2 = 0.021
    assert _keep("seq_mean_k2", 0.1) == [[0, 0, 0], [1, 1, 0]]
    # options joined by commas: a token must pass all; one threshold per option
    assert _keep("token_k1,seq_sum_k1", "2.5,0.4_2.5") == [[1, 0, 1], [1, 1, 0]]
    assert _keep("token_k1, token_k2", "2.5, 0.1") == [[1, 0, 0], [1, 1, 0]]


@pytest.mark.parametrize(
    "option, threshold, match",
    [
        ("token_k2", "0.5_2.0", "one upper bound"),  # k2 / k3 take an upper bound only
        ("token_k1,token_k2", "2.0,0.1,0.3", "one per option"),
        ("seq_max_k1", 2.0, "unknown option"),  # a maximum of a signed k1 bounds nothing: not a verl option
        ("token_k3", None, "needs a threshold"),
    ],
)
def test_divergence_rejection_bad_values(option, threshold, match):
    with pytest.raises(ValueError, match=match):
        _keep(option, threshold)


def test_bypass_reinforce_loss_by_hand():
    from fusedrl.algorithms.rollout_correction import bypass_correction, reinforce_policy_loss

    # bypass mode: the current policy is OLD here, the rollout ROLLOUT (log-probs 0)
    log_prob = OLD.clone().requires_grad_(True)
    keep, w = bypass_correction(
        log_prob,
        ROLLOUT,
        MASK,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=False,
        rollout_rs="token_k2",
        rollout_rs_threshold=0.1,
        loss_type="reinforce",
    )
    assert keep.tolist() == [[1, 0, 0], [1, 1, 0]]  # token_k2 <= 0.1, as above
    assert torch.allclose(w, torch.tensor([[1.5, 2.0, 0.5], [1.2, 1.25, 0.0]]), atol=TOL)  # min(ratio, 2)
    adv = torch.ones(2, 3)
    # token-mean over the mini-batch's 5 valid tokens (the rejected ones still count, as verl's batch_num_tokens)
    loss, metrics = reinforce_policy_loss(
        log_prob, ROLLOUT, adv, keep, weights=w, loss_agg_mode="token-mean", global_norm=5.0
    )
    # -(1.5 * log 1.5 + 1.2 * log 1.2 + 1.25 * log 1.25) / 5
    expected = -(1.5 * math.log(1.5) + 1.2 * math.log(1.2) + 1.25 * math.log(1.25)) / 5
    assert float(loss.detach()) == pytest.approx(expected, abs=TOL)
    loss.backward()
    # d/d log pi = -w * A / 5 on kept tokens: -0.3, -0.24, -0.25
    assert torch.allclose(log_prob.grad, torch.tensor([[-0.3, 0.0, 0.0], [-0.24, -0.25, 0.0]]), atol=TOL)
    # ppo_kl: mean over kept tokens of log pi_rollout - log pi = -(log 1.5 + log 1.2 + log 1.25) / 3
    assert float(metrics["ppo_kl"]) == pytest.approx(-(math.log(1.5 * 1.2 * 1.25)) / 3, abs=TOL)
    # PPO-clip in bypass mode: rejection only, no weights (its ratio is the IS ratio)
    _, none = bypass_correction(
        log_prob,
        ROLLOUT,
        MASK,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=False,
        rollout_rs=None,
        rollout_rs_threshold=None,
        loss_type="ppo_clip",
    )
    assert none is None
