"""Advantage estimators and the registries, checked against values worked out by hand."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from fusedrl.algorithms import advantages as adv_mod
from fusedrl.algorithms.registry import (
    get_adv_estimator,
    list_adv_estimators,
    load_function,
    register_adv_estimator,
)

GARBAGE = 1e4  # written at padded positions; must never show up in a result


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


def outcome_batch(scores: list[float], lengths: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards placed on the last valid token, garbage on the padding."""
    rewards = torch.full((len(scores), t), GARBAGE)
    mask = torch.zeros(len(scores), t)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, :n] = 0.0
        rewards[i, n - 1] = s
        mask[i, :n] = 1.0
    return rewards, mask


# ----------------------------------------------------------------------------------------------- grpo
def test_grpo_group_of_two_and_three_and_singleton():
    # groups: a = {1, 0}, b = {1, 2, 6}, c = {2} (interleaved on purpose)
    rewards, mask = outcome_batch([1, 1, 0, 2, 6, 2], [3, 2, 3, 1, 3, 2], t=3)
    index = ["a", "b", "a", "b", "b", "c"]
    adv, ret = get_adv_estimator("grpo")(rewards, mask, index)
    # a: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071068 -> +-0.5 / 0.7071068 = +-0.7071068
    # b: mean 3, squared deviations 4 + 1 + 9 = 14, var 14 / 2 = 7, std 2.6457513
    #    -> (1-3)/2.6457513 = -0.7559289, (2-3)/.. = -0.3779645, (6-3)/.. = 1.1338934
    # c: singleton -> mean 0, std 1 -> 2 / (1 + 1e-6) = 1.999998
    per_row = [0.7071068, -0.7559289, -0.7071068, -0.3779645, 1.1338934, 1.999998]
    expected = torch.tensor(per_row).unsqueeze(-1) * mask
    close(adv, expected)
    close(ret, expected)
    assert (adv[mask == 0] == 0).all()


def test_grpo_without_std_is_dr_grpo():
    rewards, mask = outcome_batch([1, 2, 6, 2], [1, 2, 3, 3], t=3)
    adv, _ = get_adv_estimator("grpo")(rewards, mask, [0, 0, 0, 1], norm_adv_by_std_in_grpo=False)
    # b = {1, 2, 6}: mean 3 -> -2, -1, 3; singleton keeps its raw reward 2
    expected = torch.tensor([-2.0, -1.0, 3.0, 2.0]).unsqueeze(-1) * mask
    close(adv, expected)


def test_grpo_epsilon_and_index_types():
    rewards, mask = outcome_batch([1, 0], [2, 2], t=2)
    # 0.5 / (0.7071068 + 0.5) = 0.4142136
    for index in (["u", "u"], np.array(["u", "u"], dtype=object), torch.tensor([7, 7]), (3, 3)):
        adv, _ = get_adv_estimator("grpo")(rewards, mask, index, epsilon=0.5)
        close(adv, [[0.4142136, 0.4142136], [-0.4142136, -0.4142136]])


def test_grpo_ignores_uniform_extra_kwargs_and_checks_index_length():
    rewards, mask = outcome_batch([1, 0], [2, 2], t=2)
    adv, _ = get_adv_estimator("grpo")(
        rewards, mask, ["u", "u"], values=torch.zeros(2, 2), gamma=0.9, lam=0.5
    )
    close(adv[:, 0], [0.7071068, -0.7071068])
    with pytest.raises(ValueError, match="group ids"):
        get_adv_estimator("grpo")(rewards, mask, ["u"])


def test_grpo_all_equal_group_gives_zero():
    rewards, mask = outcome_batch([1, 1, 1], [1, 2, 3], t=3)
    adv, _ = get_adv_estimator("grpo")(rewards, mask, ["g"] * 3)
    close(adv, torch.zeros(3, 3))


# ----------------------------------------------------------------------------------------------- rloo
def test_rloo_leave_one_out():
    rewards, mask = outcome_batch([1, 2, 6, 1, 0, 5], [1, 2, 3, 2, 2, 3], t=3)
    adv, ret = get_adv_estimator("rloo")(rewards, mask, ["b", "b", "b", "a", "a", "s"])
    # b: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    # a: 1 - 0 = 1, 0 - 1 = -1; singleton s keeps 5 (no other sample to form a baseline)
    expected = torch.tensor([-3.0, -1.5, 4.5, 1.0, -1.0, 5.0]).unsqueeze(-1) * mask
    close(adv, expected)
    close(ret, expected)


# ------------------------------------------------------------------------------------ reinforce++
def test_discounted_returns_skip_masked_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, GARBAGE], [0.0, GARBAGE, 1.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 1]])
    ret = adv_mod.discounted_returns(rewards, mask, gamma=0.5)
    # row0: [0.25, 0.5, 1]; row1: [1, 2, 0]; row2: the masked middle token is skipped, not
    # discounted through -> [0.5, 0, 1]
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [0.5, 0.0, 1.0]])


def test_reinforce_plus_plus_whitens_over_batch_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, GARBAGE]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus")(rewards, mask, ["x", "y"], gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # valid returns 0.25, 0.5, 1, 1, 2: mean 0.95; squared deviations .49 .2025 .0025 .0025 1.1025
    # sum 1.8 -> unbiased var 0.45 -> 1/std = 1.4907120
    inv_std = 1 / math.sqrt(0.45)
    expected = [
        [-0.70 * inv_std, -0.45 * inv_std, 0.05 * inv_std],
        [0.05 * inv_std, 1.05 * inv_std, 0.0],
    ]
    close(adv, expected)


def test_reinforce_plus_plus_baseline():
    # rows: group a = {1, 0 (one padded token)}, singleton b = {3}
    rewards = torch.tensor([[0.0, 1.0], [0.0, GARBAGE], [0.0, 3.0]])
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 1]])
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(rewards, mask, ["a", "a", "b"])
    # baseline-subtracted: row0 0.5, row1 -0.5, row2 3 (singleton baseline 0)
    # valid tokens 0.5, 0.5, -0.5, 3, 3: mean 1.3; squared deviations .64 .64 3.24 2.89 2.89 = 10.3
    # unbiased var 10.3 / 4 = 2.575
    s = math.sqrt(2.575)
    expected = [[-0.8 / s, -0.8 / s], [-1.8 / s, 0.0], [1.7 / s, 1.7 / s]]
    close(adv, expected)


# ----------------------------------------------------------------------------------------------- opo
def test_opo_length_weighted_baseline():
    rewards, mask = outcome_batch([1, 0, 1, 2], [1, 2, 3, 2], t=3)
    adv, _ = get_adv_estimator("opo")(rewards, mask, ["g", "g", "g", "s"])
    # baseline = (1*1 + 2*0 + 3*1) / (1 + 2 + 3) = 4/6; singleton baseline 0
    b = 4 / 6
    expected = torch.tensor([1 - b, 0 - b, 1 - b, 2.0]).unsqueeze(-1) * mask
    close(adv, expected)


def test_opo_equal_lengths_is_group_mean():
    rewards, mask = outcome_batch([1, 0, 0, 0], [2, 2, 2, 2], t=2)
    adv, _ = get_adv_estimator("opo")(rewards, mask, ["g"] * 4)
    close(adv[:, 0], [0.75, -0.25, -0.25, -0.25])


# ----------------------------------------------------------------------------------------------- gae
def _gae_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 99.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    return rewards, values, mask


def test_gae_hand_computed():
    rewards, values, mask = _gae_case()
    adv, ret = get_adv_estimator("gae")(rewards, mask, None, values=values, gamma=0.9, lam=0.8)
    # row0 (gamma*lam = 0.72):
    #   t2: delta = 1 - 0.7 = 0.3                      A2 = 0.3
    #   t1: delta = 0.9*0.7 - 0.6 = 0.03               A1 = 0.03 + 0.72*0.3 = 0.246
    #   t0: delta = 0.9*0.6 - 0.5 = 0.04               A0 = 0.04 + 0.72*0.246 = 0.21712
    # row1 (last valid token is t1, next value 0):
    #   t1: delta = 1 - 0.4 = 0.6                      A1 = 0.6
    #   t0: delta = 0.9*0.4 - 0.2 = 0.16               A0 = 0.16 + 0.72*0.6 = 0.592
    raw = [0.21712, 0.246, 0.3, 0.592, 0.6]
    close(ret, [[0.71712, 0.846, 1.0], [0.792, 1.0, 0.0]])
    mu, sd = statistics.mean(raw), statistics.stdev(raw)
    expected = [
        [(raw[0] - mu) / sd, (raw[1] - mu) / sd, (raw[2] - mu) / sd],
        [(raw[3] - mu) / sd, (raw[4] - mu) / sd, 0],
    ]
    close(adv, expected, atol=1e-4)


def test_gae_skips_masked_middle_token():
    # row0 of the hand case with a masked (e.g. tool-output) token inserted at position 1
    rewards = torch.tensor([[0.0, 77.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 123.0, 0.6, 0.7]])
    mask = torch.tensor([[1.0, 0, 1, 1]])
    _, ret = get_adv_estimator("gae")(rewards, mask, None, values=values, gamma=0.9, lam=0.8)
    close(ret, [[0.71712, 0.0, 0.846, 1.0]])


def test_gae_needs_values():
    rewards, _, mask = _gae_case()
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(rewards, mask, None)


# ------------------------------------------------------------------------------- padding invariance
@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gae"]
)
def test_extra_padding_does_not_change_results(name):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, 4, generator=g)
    values = torch.rand(6, 4, generator=g)
    mask = torch.tensor(
        [[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    )
    index = ["a", "a", "b", "b", "b", "c"]
    fn = get_adv_estimator(name)
    adv, ret = fn(rewards, mask, index, values=values, gamma=0.9, lam=0.95)
    # three more padded columns full of garbage (and NaN) must change nothing
    pad = torch.full((6, 3), float("nan"))
    adv_p, ret_p = fn(
        torch.cat([rewards, pad], 1),
        torch.cat([mask, torch.zeros(6, 3)], 1),
        index,
        values=torch.cat([values, pad], 1),
        gamma=0.9,
        lam=0.95,
    )
    close(adv_p[:, :4], adv)
    close(ret_p[:, :4], ret)
    assert (adv_p[:, 4:] == 0).all() and (adv_p[:, :4][mask == 0] == 0).all()


def test_bf16_input_computes_in_float32():
    rewards, mask = outcome_batch([1, 0], [2, 2], t=2)
    adv, _ = get_adv_estimator("grpo")(rewards.bfloat16(), mask, ["u", "u"])
    assert adv.dtype == torch.float32


# ----------------------------------------------------------------------------------------- registry
def test_registry_lists_and_unknown_name():
    assert {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gae"} <= set(
        list_adv_estimators()
    )
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator") as err:
        get_adv_estimator("no_such_estimator")
    assert "grpo" in str(err.value) and "no_such_estimator" in str(err.value)


def test_register_custom_estimator_and_duplicate_name():
    @register_adv_estimator("test_only_zero_adv")
    def zero(token_level_rewards, response_mask, index, **kwargs):
        z = torch.zeros_like(token_level_rewards)
        return z, z

    assert get_adv_estimator("test_only_zero_adv") is zero
    with pytest.raises(ValueError, match="already registered"):

        @register_adv_estimator("test_only_zero_adv")
        def other(token_level_rewards, response_mask, index, **kwargs):
            return token_level_rewards, token_level_rewards


def test_load_function_module_paths():
    from fusedrl.algorithms.kl import kl_penalty

    assert load_function("fusedrl.algorithms.kl:kl_penalty") is kl_penalty
    assert load_function("fusedrl.algorithms.kl.kl_penalty") is kl_penalty
    with pytest.raises(ImportError, match="fusedrl.no_such_module"):
        load_function("fusedrl.no_such_module:f")
    with pytest.raises(AttributeError, match="nope"):
        load_function("fusedrl.algorithms.kl:nope")
    with pytest.raises(ValueError):
        load_function("justaname")


def test_load_function_file_path(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(x):\n    return x * 2\n")
    fn = load_function(f"{f}:score")
    assert fn(21) == 42
    assert load_function(f"{f}:score") is fn  # second load reuses the module
    with pytest.raises(ImportError, match="missing.py"):
        load_function(f"{tmp_path / 'missing.py'}:score")
    with pytest.raises(AttributeError, match="other"):
        load_function(f"{f}:other")


# -------------------------------------------------------------------------------------------- gdpo
def test_gdpo_normalises_each_component_in_its_group_then_whitens():
    # two groups (u1: rows 0-1, u2: rows 2-3); components accuracy [1, 0, 1, 1], format [1, 1, 0, 1];
    # weights [2, 1]; row 3 has 1 valid token, the others 2.
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    components = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    rewards = torch.zeros(4, 2)  # unused when the components are given
    adv, ret = get_adv_estimator("gdpo")(
        rewards, mask, ["u1", "u1", "u2", "u2"], reward_components=components, reward_weights=[2.0, 1.0]
    )
    # GRPO per component (unbiased std of a pair {x, y} = |x - y| / sqrt 2, a = 1 / sqrt 2):
    #   accuracy: u1 {1, 0} -> +a, -a; u2 {1, 1} -> 0, 0
    #   format:   u1 {1, 1} -> 0, 0;   u2 {0, 1} -> -a, +a
    # weighted sum 2 * acc + fmt = [2a, -2a, -a, a] on 2, 2, 2, 1 tokens
    # batch whitening over the 7 tokens: mean = (4a - 4a - 2a + a) / 7 = -a / 7
    #   deviations 15a/7, -13a/7, -6a/7, 8a/7; unbiased var = a^2 (2*225 + 2*169 + 2*36 + 64) / 49 / 6
    #   = 0.5 * 924 / 294 = 11/7, so A = [15, -13, -6, 8] * a / 7 / sqrt(11/7) = [15, -13, -6, 8] * a / sqrt(77)
    a = 1 / math.sqrt(2)
    expected = (
        torch.tensor([15.0, -13.0, -6.0, 8.0]) * a / math.sqrt(77)
    )  # [1.2087, -1.0476, -0.4835, 0.6447]
    close(adv, expected.unsqueeze(-1) * mask)
    assert torch.equal(adv, ret)
    # GRPO on the summed reward 2 * acc + fmt = [3, 1, 2, 3] would give u1 +-a and u2 -+a: the weights'
    # effect inside each group is lost there, which is what GDPO keeps.


def test_gdpo_without_components_is_grpo_then_batch_whitening():
    rewards, mask = outcome_batch([1.0, 0.0, 0.0, 0.0], [2, 2, 2, 2], 2)
    adv, _ = get_adv_estimator("gdpo")(rewards, mask, ["u", "u", "v", "v"])
    # GRPO: u {1, 0} -> +a, -a; v {0, 0} -> 0, 0; tokens [a, a, -a, -a, 0, 0, 0, 0]: mean 0,
    # unbiased var = 4 a^2 / 7 = 2/7 -> A = a / sqrt(2/7) = sqrt(7) / 2 = 1.3229
    close(adv, [[math.sqrt(7) / 2] * 2, [-math.sqrt(7) / 2] * 2, [0.0, 0.0], [0.0, 0.0]])


def test_gdpo_weights_must_match_components():
    with pytest.raises(ValueError, match="algorithm.gdpo_reward_weights"):
        get_adv_estimator("gdpo")(
            torch.zeros(2, 1),
            torch.ones(2, 1),
            ["u", "u"],
            reward_components=torch.ones(2, 2),
            reward_weights=[1.0],
        )


def test_gdpo_components_come_from_the_scorer_dict_by_key():
    from fusedrl.trainer.step_plan import reward_components

    extras = [{"acc": 1.0, "fmt": 0.5}, {}, {"acc": 0.0, "fmt": 1.0}]  # row 1: empty response, no dict
    out = reward_components(["fmt", "acc"], extras, 3)
    assert torch.equal(out, torch.tensor([[0.5, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match=r"gdpo_reward_keys: 'length'.*keys seen: \['acc', 'fmt'\]"):
        reward_components(["acc", "length"], extras, 3)
    with pytest.raises(ValueError, match=r"\+algorithm.gdpo_reward_keys="):
        reward_components([], extras, 3)
