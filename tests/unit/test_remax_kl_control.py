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


def test_adaptive_kl_counts_rows_as_verl_does():
    # verl updates the in-reward KL coefficient with n_steps = the batch's rows (train_batch_size x rollout.n).
    # 8 prompts x n = 4 -> 32 rows; every token has k1 = old - ref = 0.3, so the measured KL is 0.3.
    from types import SimpleNamespace

    from fusedrl.batch import RolloutBatch
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    rows, width = 32, 2
    config = SimpleNamespace(
        algorithm=SimpleNamespace(kl_penalty="kl"), data=SimpleNamespace(train_batch_size=8)
    )
    fake = SimpleNamespace(run=config, kl_ctrl=build_kl_controller("adaptive", 0.001, 0.1, 10000))
    for _ in range(100):
        batch = RolloutBatch(
            prompts=torch.zeros(rows, 1, dtype=torch.long),
            prompt_mask=torch.ones(rows, 1, dtype=torch.long),
            response_mask=torch.ones(rows, width, dtype=torch.long),
            token_level_scores=torch.zeros(rows, width),
            old_log_probs=torch.full((rows, width), -1.0),
            ref_log_probs=torch.full((rows, width), -1.3),
            batch_size=[rows],
        )
        PPOTrainer.apply_kl_penalty(fake, batch, {})
    # error = clip(0.3 / 0.1 - 1, -0.2, 0.2) = 0.2; per step beta *= 1 + 0.2 * 32 / 10000 = 1.00064;
    # after 100 steps 0.001 * 1.00064 ** 100 = 0.001 * exp(100 * ln 1.00064) = 0.001 * exp(0.063980) = 0.00106607
    # (with n_steps = train_batch_size = 8: 0.001 * 1.00016 ** 100 = 0.00101613)
    assert fake.kl_ctrl.value == pytest.approx(0.001 * 1.00064**100, rel=1e-9)
    assert fake.kl_ctrl.value == pytest.approx(0.00106607, abs=5e-9)
