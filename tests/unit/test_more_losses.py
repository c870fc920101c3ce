"""GPG, CISPO and GMPO (geo_mean) losses and the GPG estimator against hand-computed values."""

from __future__ import annotations

import math

import torch

from fusedrl.algorithms import get_adv_estimator, get_policy_loss

# float32 arithmetic on a handful of O(1) terms: a few ulps of 1.0 each.
TOL = 1e-6


def _grad(loss_fn, log_prob, old, adv, mask, **kw):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = loss_fn(lp, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_gpg_loss_is_plain_policy_gradient():
    log_prob = torch.tensor([[-1.0, -2.0, -5.0]])
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding
    loss, grad, _ = _grad(get_policy_loss("gpg"), log_prob, torch.zeros(1, 3), adv, mask)
    # token-mean over 2 tokens: -(2 * -1 + 2 * -2) / 2 = 3; d/dlogp = -A / 2 = -1 on valid tokens.
    assert abs(float(loss) - 3.0) < TOL
    assert torch.allclose(grad, torch.tensor([[-1.0, -1.0, 0.0]]), atol=TOL)


def test_cispo_clips_the_weight_not_the_gradient():
    log_prob = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, grad, metrics = _grad(
        get_policy_loss("cispo"),
        log_prob,
        torch.zeros(1, 3),
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    w = [1.2, 0.8, 1.1]  # ratios 1.5, 0.5, 1.1 clipped to [0.8, 1.2]
    expected = (-w[0] * math.log(1.5) - w[1] * math.log(0.5) + w[2] * math.log(1.1)) / 3
    assert abs(float(loss) - expected) < TOL
    # Every token keeps a gradient (PPO would zero the two clipped ones): -w * A / 3.
    assert torch.allclose(grad, torch.tensor([[-1.2 / 3, -0.8 / 3, 1.1 / 3]]), atol=TOL)
    assert abs(float(metrics["pg_clipfrac"]) - 2 / 3) < TOL


def test_gmpo_geometric_mean_with_sign_aware_log_clip():
    # Sequence 1 (A = +1): log-ratios 0.3 (clipped to 0.2) and -0.1 -> mean 0.05 -> loss -e^0.05.
    # Sequence 2 (A = -1, 2 valid tokens): 0.1 and -0.3; with A < 0 the pessimistic side is max(l, clip(l))
    # = 0.1 and -0.2 -> mean -0.05 -> loss +e^-0.05. Batch: mean over the 2 sequences.
    log_prob = torch.tensor([[0.3, -0.1, 0.0], [0.1, -0.3, 9.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    fn = get_policy_loss("geo_mean")
    loss, grad, metrics = _grad(
        fn,
        log_prob,
        torch.zeros(2, 3),
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        loss_agg_mode="token-mean",
    )
    assert fn.agg_mode == "seq-mean-token-mean"  # the paper's aggregation, whatever loss_agg_mode says
    assert abs(float(loss) - (-math.exp(0.05) + math.exp(-0.05)) / 2) < TOL
    # d loss / d l_t = -A_i * rho_i / n_i / 2 where the token is not clipped, 0 where it is.
    expected = torch.tensor([[0.0, -math.exp(0.05) / 4, 0.0], [math.exp(-0.05) / 4, 0.0, 0.0]])
    assert torch.allclose(grad, expected, atol=TOL)
    assert abs(float(metrics["pg_clipfrac"]) - 1 / 4) < TOL  # seq 1 token 0 (A > 0)
    assert abs(float(metrics["pg_clipfrac_lower"]) - 1 / 4) < TOL  # seq 2 token 1 (A < 0)


def test_gpg_estimator_rescales_by_nonzero_share():
    rewards = torch.zeros(4, 3)
    rewards[0, 1] = 1.0  # only sample 0 scores
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    adv, ret = get_adv_estimator("gpg")(rewards, mask, index=["a", "a", "b", "b"])
    # group a: mean 0.5; group b: mean 0; alpha = B / M = 4 / 1.
    expected = torch.tensor([2.0, -2.0, 0.0, 0.0]).unsqueeze(-1) * mask
    assert torch.allclose(adv, expected, atol=TOL) and torch.equal(adv, ret)


def test_grpo_with_one_sample_per_prompt_uses_the_raw_score():
    # verl: a one-sample group has mean 0 and std 1, so n=1 GRPO trains on the (normalised) raw score.
    rewards = torch.tensor([[0.0, 3.0], [0.5, 0.0]])
    mask = torch.ones(2, 2)
    adv, _ = get_adv_estimator("grpo")(rewards, mask, index=["p", "q"])
    assert torch.allclose(adv, torch.tensor([[3.0, 3.0], [0.5, 0.5]]) / (1 + 1e-6), atol=TOL)


def test_sapo_gate_at_the_old_policy():
    # r = 1 everywhere: gate = sigmoid(0) * 4 / tau = 2 / tau; loss tokens -2 (A=+1, tau_pos=1) and
    # +2/1.05 (A=-1, tau_neg=1.05); one sequence of 2 tokens -> their mean. f'(1) = 1: the gradient is
    # PPO's, -A / 2 per token.
    fn = get_policy_loss("sapo")
    assert fn.agg_mode == "seq-mean-token-mean" and fn.config_keys == ("tau_pos", "tau_neg")
    loss, grad, _ = _grad(
        fn,
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
        tau_pos=1.0,
        tau_neg=1.05,
    )
    assert abs(float(loss) - (-2.0 + 2.0 / 1.05) / 2) < TOL
    assert torch.allclose(grad, torch.tensor([[-0.5, 0.5]]), atol=TOL)


def test_sapo_gate_fades_far_from_the_old_policy():
    # r = e (log-ratio 1), A = +1, tau = 1: gate = 4 sigmoid(e - 1); d loss / d log r = -4 s (1 - s) r.
    fn = get_policy_loss("sapo")
    loss, grad, _ = _grad(fn, torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    s = 1 / (1 + math.exp(-(math.e - 1)))
    assert abs(float(loss) + 4 * s) < 4 * TOL
    assert abs(float(grad) + 4 * s * (1 - s) * math.e) < 4 * TOL
