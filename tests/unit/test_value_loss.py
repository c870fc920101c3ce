"""The clipped value loss against hand-computed numbers, including padding and the clipped branch."""

from __future__ import annotations

import pytest
import torch

from fusedrl.algorithms.value import value_loss


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# Two rows, two valid tokens each, one padded column holding large garbage that must not count.
# cliprange 0.5; per token (v, old, R):
#   row 0, t0: (1.0, 0.8, 1.5)  v-old = 0.2 inside the clip -> v_clip = v; 0.5 * 0.25 = 0.125
#   row 0, t1: (2.0, 1.0, 0.0)  v_clip = 1.5: err 4 vs 2.25 -> unclipped wins; 0.5 * 4 = 2.0
#   row 1, t0: (0.5, 0.5, 1.0)  v_clip = v; 0.5 * 0.25 = 0.125
#   row 1, t1: (3.0, 4.0, 3.0)  v_clip = 3.5: err 0 vs 0.25 -> clipped wins; 0.5 * 0.25 = 0.125
VALUES = torch.tensor([[1.0, 2.0, 100.0], [0.5, 3.0, -100.0]])
OLD = torch.tensor([[0.8, 1.0, 0.0], [0.5, 4.0, 0.0]])
RETURNS = torch.tensor([[1.5, 0.0, -100.0], [1.0, 3.0, 100.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])
CLIP = 0.5


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (0.125 + 2.0 + 0.125 + 0.125) / 4),
        ("seq-mean-token-sum", ((0.125 + 2.0) + (0.125 + 0.125)) / 2),
        ("seq-mean-token-mean", ((0.125 + 2.0) / 2 + (0.125 + 0.125) / 2) / 2),
        ("seq-mean-token-sum-norm", (0.125 + 2.0 + 0.125 + 0.125) / (2 * 3)),
    ],
)
def test_value_loss_hand_computed(mode, expected):
    loss, metrics = value_loss(VALUES, OLD, RETURNS, MASK, cliprange_value=CLIP, loss_agg_mode=mode)
    close(loss, expected)
    close(metrics["vf_clipfrac"], 1 / 4)  # only row 1, t1 takes the clipped branch
    close(metrics["vpred_mean"], (1.0 + 2.0 + 0.5 + 3.0) / 4)
    assert not metrics["vf_clipfrac"].requires_grad


def test_padding_content_is_ignored():
    garbage = VALUES.clone()
    garbage[:, 2] = float("nan")
    returns = RETURNS.clone()
    returns[:, 2] = float("inf")
    loss, metrics = value_loss(garbage, OLD, returns, MASK, cliprange_value=CLIP)
    close(loss, 2.375 / 4)
    close(metrics["vpred_mean"], 1.625)


def test_global_norm_splits_add_up():
    full, _ = value_loss(VALUES, OLD, RETURNS, MASK, cliprange_value=CLIP)
    parts = [
        value_loss(
            VALUES[i : i + 1],
            OLD[i : i + 1],
            RETURNS[i : i + 1],
            MASK[i : i + 1],
            cliprange_value=CLIP,
            global_norm=4.0,
        )[0]
        for i in range(2)
    ]
    close(parts[0] + parts[1], full)
    close(value_loss(VALUES, OLD, RETURNS, MASK, cliprange_value=CLIP, global_norm=8.0)[0], 2.375 / 8)


def test_gradient_two_tokens():
    # t0: (v 1.0, old 0.8, R 1.5) inside the clip: d/dv 0.5 (v - R)^2 / N = (1.0 - 1.5) / 2 = -0.25.
    # t1: (v 2.0, old 1.0, R 3.0): v_clip = 1.5, err 1 vs 2.25 -> the clipped branch is the max and
    #     its clamp is saturated, so the loss does not depend on v there: gradient 0.
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0]])
    returns = torch.tensor([[1.5, 3.0]])
    mask = torch.ones(1, 2)
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=CLIP)
    close(loss, (0.5 * 0.25 + 0.5 * 2.25) / 2)
    close(metrics["vf_clipfrac"], 0.5)
    loss.backward()
    close(values.grad, [[-0.25, 0.0]])


def test_gradcheck_away_from_kinks():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    old = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    returns = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)

    def fn(v: torch.Tensor) -> torch.Tensor:
        return value_loss(v, old, returns, mask, cliprange_value=0.3)[0]

    assert torch.autograd.gradcheck(fn, (values,), eps=1e-6, atol=1e-6)


def test_low_precision_inputs_are_upcast():
    loss, _ = value_loss(VALUES.bfloat16(), OLD.bfloat16(), RETURNS.bfloat16(), MASK, cliprange_value=CLIP)
    assert loss.dtype == torch.float32
    close(loss, 2.375 / 4, atol=1e-3)


def test_negative_cliprange_rejected():
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(VALUES, OLD, RETURNS, MASK, cliprange_value=-0.1)
