"""The optimal token baseline (``optimal_token_baseline``) and the Σπ² it reads, against hand-computed values."""

from __future__ import annotations

import math

import torch

from fusedrl.algorithms import get_adv_estimator, get_adv_traits

# float32 arithmetic on a handful of O(1) terms (plus epsilon=1e-8 in a denominator >= 0.5): a few ulps.
TOL = 1e-6


def _batch():
    # Group "a": rows 0 and 1; group "b": row 2 alone. pi = exp(old_log_probs) of the sampled token.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    pi = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.25, 0.5], [0.5, 0.5, 0.5]])
    # Row 1's third slot is padding: NaN there must not leak into the running sums.
    sum_pi_sq = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.25, float("nan")], [0.5, 0.5, 0.5]])
    return rewards, mask, torch.log(pi), sum_pi_sq


def test_optimal_token_baseline_by_hand():
    rewards, mask, old, spp = _batch()
    adv, ret = get_adv_estimator("optimal_token_baseline")(
        rewards, mask, index=["a", "a", "b"], old_log_probs=old, sum_pi_squared=spp
    )
    # Energies w = 1 - 2 pi + Σπ²: row 0 [.5, .5, .5] -> W [.5, 1, 1.5]; row 1 [0, .75] -> W [0, .75].
    # Returns: row 0 [1, 1, 1], row 1 [0, 0]. Baselines of group a:
    #   t0: (1 * .5 + 0 * 0) / (.5 + 0) = 1;  t1: (1 * 1 + 0 * .75) / 1.75 = 4/7;  t2: row 0 alone: 1.
    expected = torch.tensor([[0.0, 3 / 7, 0.0], [-1.0, -4 / 7, 0.0], [2.0, 2.0, 0.0]])
    assert torch.allclose(adv, expected, atol=TOL), adv
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 2.0, 0.0]]))
    assert get_adv_traits("optimal_token_baseline").needs_sum_pi_squared


def test_optimal_token_baseline_with_rollout_is_weights():
    rewards, mask, old, spp = _batch()
    weights = torch.ones(3, 3)
    weights[1, 1] = 2.0  # row 1's t1 energy .75 -> .75 * 2^2 = 3, so W[1] = [0, 3]
    adv, _ = get_adv_estimator("optimal_token_baseline")(
        rewards,
        mask,
        index=["a", "a", "b"],
        old_log_probs=old,
        sum_pi_squared=spp,
        rollout_is_weights=weights,
    )
    # t1 baseline: (1 * 1 + 0 * 3) / 4 = 0.25.
    assert math.isclose(float(adv[0, 1]), 0.75, abs_tol=TOL)
    assert math.isclose(float(adv[1, 1]), -0.25, abs_tol=TOL)


def test_equal_energies_and_lengths_give_the_group_mean():
    # Same W on every row -> b_t is the plain mean of the returns (RLOO/GRPO's baseline with the self term).
    mask = torch.ones(3, 2)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5]])
    old = torch.full((3, 2), math.log(0.5))
    spp = torch.full((3, 2), 0.3)
    adv, _ = get_adv_estimator("optimal_token_baseline")(
        rewards, mask, index=[0, 0, 0], old_log_probs=old, sum_pi_squared=spp
    )
    expected = (rewards.sum(-1) - 0.5).unsqueeze(-1).expand(3, 2)
    assert torch.allclose(adv, expected, atol=TOL)


def test_token_log_probs_sum_pi_squared_matches_softmax():
    from fusedrl.workers.chunked_head import whole_token_log_probs

    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]], [[0.0, 0.0, 0.0, 0.0]]])  # [2, 1, V=4]
    targets = torch.tensor([[0], [3]])
    t = 0.7
    _, spp = whole_token_log_probs(
        logits, targets, temperature=t, with_entropy=False, with_sum_pi_squared=True
    )
    pi = torch.softmax(logits / t, dim=-1)
    assert torch.allclose(spp, (pi**2).sum(-1), atol=TOL)
    assert math.isclose(float(spp[1, 0]), 0.25, abs_tol=TOL)  # uniform over 4: 4 * (1/4)^2


def _tir_batch():
    """Multi-turn rows (observation columns have response_mask 0) in four groups."""
    nan = float("nan")
    mask = torch.tensor(
        [
            [1.0, 0.0, 0.0, 1.0, 1.0],  # a: a sampled token, a 2-token observation, two sampled tokens
            [1.0, 1.0, 1.0, 0.0, 0.0],  # a: three sampled tokens in a row
            [1.0, 1.0, 0.0, 0.0, 0.0],  # b: alone
            [1.0, 1.0, 1.0, 0.0, 0.0],  # c: strictly the longest of its group
            [1.0, 0.0, 0.0, 0.0, 0.0],  # c
            [1.0, 1.0, 0.0, 0.0, 0.0],  # d
            [0.0, 0.0, 0.0, 0.0, 0.0],  # d: no sampled token
        ]
    )
    rewards = torch.zeros(7, 5)
    rewards[0, 4], rewards[2, 1], rewards[3, 2], rewards[5, 1] = 1.0, 2.0, 1.0, 1.0
    pi = torch.full((7, 5), 0.5)
    spp = torch.full((7, 5), 0.5)
    pi[1, :3], spp[1, :3] = torch.tensor([1.0, 0.25, 0.5]), torch.tensor([1.0, 0.25, 0.5])
    spp[0, 1:3] = 9.0  # observation columns: their energy (9) must not count
    spp[1, 3:] = nan  # padding
    return rewards, mask, torch.log(pi), spp, ["a", "a", "b", "c", "c", "d", "d"]


def test_tir_optimal_token_baseline_by_hand():
    rewards, mask, old, spp, index = _tir_batch()
    adv, ret = get_adv_estimator("tir_optimal_token_baseline")(
        rewards, mask, index=index, old_log_probs=old, sum_pi_squared=spp
    )
    # Group a, aligned on the sampled-token count k (row 0's tokens sit in columns 0, 3, 4):
    #   row 0: G = [1, 1, 1], w = .5 each -> W = [.5, 1, 1.5];  row 1: G = [0, 0, 0], w = [0, .75, .5] -> W = [0, .75, 1.25]
    #   b_0 = (1 * .5) / .5 = 1;  b_1 = (1 * 1) / 1.75 = 4/7;  b_2 = (1 * 1.5) / 2.75 = 6/11.
    # Group b: one row, baseline 0. Group c: row 3 (3 tokens) is strictly longer than row 4 (1 token), so
    #   its baseline is 0 from k = 1 on; b_0 = (1 * .5 + 0 * .5) / 1 = .5.
    # Group d: the empty row leaves one row: baseline 0.
    expected = torch.tensor(
        [
            [0.0, 0.0, 0.0, 3 / 7, 5 / 11],
            [-1.0, -4 / 7, -6 / 11, 0.0, 0.0],
            [2.0, 2.0, 0.0, 0.0, 0.0],
            [0.5, 1.0, 1.0, 0.0, 0.0],
            [-0.5, 0.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert torch.allclose(adv, expected, atol=TOL), adv
    expected_returns = torch.tensor(
        [
            [1.0, 0.0, 0.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [2.0, 2.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 1.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert torch.equal(ret, expected_returns)
    assert get_adv_traits("tir_optimal_token_baseline").needs_sum_pi_squared
    # Column alignment (the single-turn estimator) gives row 0's second sampled token another baseline.
    otb, _ = get_adv_estimator("optimal_token_baseline")(
        rewards, mask, index=index, old_log_probs=old, sum_pi_squared=spp
    )
    assert not math.isclose(float(otb[0, 3]), 3 / 7, abs_tol=1e-3)


def test_tir_equals_the_single_turn_baseline_on_single_turn_rows_but_for_the_tail():
    rewards, mask, old, spp = _batch()
    kw = dict(index=["a", "a", "b"], old_log_probs=old, sum_pi_squared=spp)
    tir, _ = get_adv_estimator("tir_optimal_token_baseline")(rewards, mask, **kw)
    otb, _ = get_adv_estimator("optimal_token_baseline")(rewards, mask, **kw)
    # Row 0 is strictly the longest of group a: past row 1's 2 tokens its baseline is 0, not its own
    # return (OTB: advantage 0 there; TIR: the return, 1).
    assert math.isclose(float(otb[0, 2]), 0.0, abs_tol=TOL) and math.isclose(
        float(tir[0, 2]), 1.0, abs_tol=TOL
    )
    tir[0, 2] = otb[0, 2]
    assert torch.allclose(tir, otb, atol=TOL)
