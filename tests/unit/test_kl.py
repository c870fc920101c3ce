"""KL estimators and token entropy against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl.algorithms.kl import entropy_from_logits, kl_penalty

# log_prob - ref_log_prob = [0.5, -1.0]
LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


@pytest.mark.parametrize("kind", ["k1", "kl"])
def test_k1(kind):
    close(kl_penalty(LOGP, REF, kind), [[0.5, -1.0]])


def test_abs():
    close(kl_penalty(LOGP, REF, "abs"), [[0.5, 1.0]])


@pytest.mark.parametrize("kind", ["k2", "mse"])
def test_k2(kind):
    # 0.5 * 0.25, 0.5 * 1
    close(kl_penalty(LOGP, REF, kind), [[0.125, 0.5]])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_k3(kind):
    # d = ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1 = 0.1065307, e - 1 - 1 = 0.7182818
    close(kl_penalty(LOGP, REF, kind), [[math.exp(-0.5) - 0.5, math.e - 2.0]])


def test_k3_is_zero_on_policy_and_nonnegative():
    x = torch.linspace(-5, 0, 11).unsqueeze(0)
    close(kl_penalty(x, x, "k3"), torch.zeros_like(x))
    assert (kl_penalty(x, x.flip(-1), "k3") >= 0).all()


def test_k3_extreme_tokens_are_clamped_and_finite():
    logp = torch.tensor([[0.0, -100.0, float("-inf"), -1.0]])
    ref = torch.tensor([[-100.0, 0.0, -1.0, float("-inf")]])
    # d = -100 -> clamped to -20 -> e^-20 + 20 - 1 ~ 19 -> clamped to 10
    # d = 100 / +inf / -inf -> clamped to +-20 -> both branches end above 10 -> 10
    out = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(out).all()
    close(out, [[10.0, 10.0, 10.0, 10.0]])


def test_k3_gradient_finite_for_extreme_token():
    logp = torch.tensor([[-50.0, -1.0]], requires_grad=True)
    kl_penalty(logp, torch.tensor([[0.0, -1.2]]), "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()
    # second token: d = -0.2, kl = e^d - d - 1, dkl/dlogp = -(e^d - 1) = 1 - e^-0.2 = 0.1812692
    close(logp.grad[0, 1], 1 - math.exp(-0.2))


def test_unknown_kind_names_config_key():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.kl_loss_type"):
        kl_penalty(LOGP, REF, "k4")


def test_entropy_uniform_and_two_point():
    close(entropy_from_logits(torch.zeros(4)), math.log(4))
    # p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    h = entropy_from_logits(torch.tensor([0.0, math.log(3.0)]))
    close(h, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_entropy_is_stable_for_huge_logits_and_keeps_leading_shape():
    logits = torch.tensor([[1000.0, 0.0], [1e4, 1e4]])
    # one-hot -> 0; two equal logits -> ln 2 (a shift of the logits does not change entropy)
    close(entropy_from_logits(logits), [0.0, math.log(2.0)])
    assert entropy_from_logits(torch.randn(2, 3, 7)).shape == (2, 3)
