"""Clip-Cov and KL-Cov (``clip_cov`` / ``kl_cov``) against hand-computed values; the random choice is seeded."""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl.algorithms import get_policy_loss

# float32 arithmetic on a handful of O(1) terms: a few ulps of 1.0 each.
TOL = 1e-6

# One row of 4 valid tokens. mean(A) = 0, mean(log pi) = -3.25, so cov_t = A_t * (log pi_t + 3.25):
ADV = torch.tensor([[2.0, 1.0, -1.0, -2.0]])
LOGP = torch.tensor([[-1.0, -3.0, -3.0, -6.0]])
COV = [4.5, 0.25, -0.25, 5.5]
MASK = torch.ones(1, 4)


def _run(name, log_prob, old, adv, mask, **kw):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(lp, old, adv, mask, **kw)
    loss.backward()
    return float(loss.detach()), lp.grad, metrics


def test_token_covariance_by_hand():
    from fusedrl.algorithms.cov_losses import token_covariance

    cov = token_covariance(LOGP, ADV, MASK)
    assert torch.allclose(cov, torch.tensor([COV]), atol=TOL)
    padded = token_covariance(LOGP, ADV, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert padded[0, 3] == -math.inf  # padding is never selected


def test_clip_cov_detaches_the_only_candidate():
    # Candidates need 1 < cov < 5: only token 0 (4.5); token 3 (5.5) is above the bound. ratio 0.25 of 4
    # valid tokens -> 1 token, so the choice is forced whatever the seed.
    loss, grad, metrics = _run(
        "clip_cov",
        LOGP,
        LOGP.clone(),
        ADV,
        MASK,
        clip_cov_ratio=0.25,
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
        seed=7,
    )
    # ratio 1 everywhere: token-mean loss = mean(-A) = 0; d/dlogp = -A / 4 except on the detached token.
    assert abs(loss) < TOL
    assert torch.allclose(grad, torch.tensor([[0.0, -0.25, 0.25, 0.5]]), atol=TOL)
    assert math.isclose(float(metrics["cov_detached_frac"]), 0.25, abs_tol=TOL)
    assert float(metrics["pg_clipfrac"]) == 0.0


def test_clip_cov_skips_tokens_ppo_already_clipped():
    old = LOGP.clone()
    old[0, 0] -= 0.5  # token 0: ratio e^0.5 > 1.2 with A > 0 -> PPO's clipped branch
    _, grad, metrics = _run("clip_cov", LOGP, old, ADV, MASK, clip_cov_ratio=0.25, seed=0)
    assert float(metrics["cov_detached_frac"]) == 0.0  # the only candidate was clipped: nothing detached
    assert math.isclose(float(metrics["pg_clipfrac"]), 0.25, abs_tol=TOL)
    assert torch.allclose(grad, torch.tensor([[0.0, -0.25, 0.25, 0.5]]), atol=TOL)  # clip: no gradient


def test_clip_cov_random_choice_is_seeded():
    # Widen the band to (0.1, 6): tokens 0, 1 and 3 are candidates, one is detached per call.
    def detached(seed: int) -> int:
        _, grad, _ = _run(
            "clip_cov",
            LOGP,
            LOGP.clone(),
            ADV,
            MASK,
            clip_cov_ratio=0.25,
            clip_cov_ub=6.0,
            clip_cov_lb=0.1,
            seed=seed,
        )
        zero = (grad[0] == 0).nonzero().flatten().tolist()
        assert len(zero) == 1 and zero[0] in (0, 1, 3)
        return zero[0]

    assert detached(3) == detached(3)  # same seed, same token
    assert {detached(s) for s in range(30)} == {0, 1, 3}  # every candidate can be drawn


def test_kl_cov_penalises_the_largest_covariance():
    old = LOGP.clone()
    old[0, 3] -= 0.2  # token 3: log r = 0.2
    loss, grad, metrics = _run("kl_cov", LOGP, old, ADV, MASK, kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    r3 = math.exp(0.2)
    # Per token -A r: [-2, -1, 1, 2 r3]; token 3 has the largest cov (5.5): + 0.1 * |0.2|. Token-mean.
    assert math.isclose(loss, (-2 - 1 + 1 + 2 * r3 + 0.02) / 4, abs_tol=TOL)
    assert torch.allclose(grad, torch.tensor([[-2.0, -1.0, 1.0, 2 * r3 + 0.1]]) / 4, atol=TOL)
    assert math.isclose(float(metrics["kl_cov_frac"]), 0.25, abs_tol=TOL)


def test_verl_cov_keys_reach_the_loss(tmp_path):
    from fusedrl.config import ConfigError, load_config

    base = ["data.train_files=x", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
    cfg = load_config(
        [
            *base,
            "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001",
            "actor_rollout_ref.actor.policy_loss.clip_cov_lb=2.0",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ub=4.0",
        ],
        validate_config=False,
    )
    assert cfg.actor_rollout_ref.actor.policy_loss.clip_cov_ratio == 0.001
    with pytest.raises(ConfigError, match=r"kl_cov_ratio`=0.0: use \(0, 1\]"):
        load_config(
            [
                *base,
                "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
                "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0",
            ]
        )


def test_actor_loss_seed_follows_optimizer_steps():
    from fusedrl.workers.actor import loss_seed, loss_seed_base, optimizer_steps

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    assert optimizer_steps(opt) == 0
    p.grad = torch.ones(2)
    opt.step()
    opt.step()
    assert optimizer_steps(opt) == 2
    base = loss_seed_base(5)
    assert loss_seed(base, 2, 1) == loss_seed(base, 2, 1)
    assert len({loss_seed(base, s, m) for s in range(3) for m in range(3)}) == 9
