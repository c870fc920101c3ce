"""ReMax advantages and the KL-in-reward controllers against hand-computed values."""

import pytest
import torch

from fusedrl.algorithms import get_adv_estimator
from fusedrl.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
)


def test_remax_reward_to_go_minus_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])  # 9.0 sits on padding: ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_adv_estimator("remax")(rewards, mask, reward_baselines=torch.tensor([0.5, 1.0]))
    # row 0: reward-to-go [1, 1, 1] - 0.5; row 1: [2, 2, -] - 1.0, padding 0
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def test_remax_without_baseline_names_the_fix():
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(torch.zeros(1, 2), torch.ones(1, 2))


def test_adaptive_controller_moves_towards_target():
    c = AdaptiveKLController(value=0.1, target_kl=0.05, horizon=100)
    c.update(current_kl=0.1, n_steps=10)  # error = clip(0.1/0.05 - 1) = 0.2 -> x (1 + 0.2 * 10/100)
    assert c.value == pytest.approx(0.102)
    c.update(current_kl=0.0, n_steps=10)  # error = -0.2 -> x (1 - 0.02)
    assert c.value == pytest.approx(0.102 * 0.98)
    c.update(current_kl=0.06, n_steps=50)  # error = 0.2 (0.06/0.05 - 1) -> x 1.1
    assert c.value == pytest.approx(0.102 * 0.98 * 1.1)


def test_fixed_controller_and_builder():
    c = build_kl_controller("fixed", 0.3)
    c.update(10.0, 5)
    assert isinstance(c, FixedKLController) and c.value == 0.3
    with pytest.raises(ValueError, match="target_kl"):
        build_kl_controller("adaptive", 0.1, target_kl=None, horizon=10)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        build_kl_controller("pid", 0.1)


def test_kl_in_reward_subtracts_beta_times_k1():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -3.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, mean_kl = apply_kl_in_reward(scores, logp, ref, mask, beta=0.1, kind="k1")
    # k1 = logp - ref: row0 [0.5, -1.0], row1 [0, masked]
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.1], [0.0, 0.0]]))
    assert mean_kl == pytest.approx(((0.5 - 1.0) / 2 + 0.0) / 2)
