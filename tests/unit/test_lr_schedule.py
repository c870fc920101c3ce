"""Learning-rate warmup and decay (verl's optim keys) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from fusedrl.lr_schedule import lr_factor, scheduled_lr, warmup_steps


def _optim(**kw):
    base = {
        "lr": 1e-3,
        "lr_warmup_steps": -1,
        "lr_warmup_steps_ratio": 0.0,
        "warmup_style": None,
        "lr_scheduler_type": "constant",
        "min_lr_ratio": 0.0,
        "num_cycles": 0.5,
    }
    base.update(kw)
    return base


def test_constant_with_linear_warmup():
    # 4 warmup steps: 0, 1/4, 2/4, 3/4 of the rate, then the full rate.
    got = [lr_factor(s, total_steps=10, warmup=4, style="constant") for s in range(6)]
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decay_to_min_lr_ratio():
    # warmup 2, total 10: decay over steps 2..10; p = (s - 2) / 8; factor = 0.1 + 0.9 * (1 + cos(pi p)) / 2.
    for step, p in ((2, 0.0), (6, 0.5), (10, 1.0)):
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))
        got = lr_factor(step, total_steps=10, warmup=2, style="cosine", min_lr_ratio=0.1)
        assert abs(got - want) < 1e-12
    assert lr_factor(6, total_steps=10, warmup=2, style="cosine", min_lr_ratio=0.1) == pytest.approx(0.55)
    assert lr_factor(1, total_steps=10, warmup=2, style="cosine") == 0.5  # still warming up


def test_warmup_steps_from_ratio_or_count():
    assert warmup_steps(_optim(lr_warmup_steps_ratio=0.25), total_steps=20) == 5
    assert warmup_steps(_optim(lr_warmup_steps=3, lr_warmup_steps_ratio=0.25), total_steps=20) == 3


def test_scheduled_lr_reads_warmup_style_first():
    # verl's older key wins when set (cosine here, though lr_scheduler_type says constant).
    optim = _optim(lr_warmup_steps=0, warmup_style="cosine", lr_scheduler_type="constant")
    assert scheduled_lr(optim, 5, total_steps=10) == pytest.approx(1e-3 * 0.5)
    # The schedule is a function of the step alone: a resumed run at step 5 gets the same rate.
    assert scheduled_lr(optim, 5, total_steps=10) == scheduled_lr(dict(optim), 5, total_steps=10)
    assert scheduled_lr(_optim(), 7, total_steps=10) == 1e-3  # the defaults: constant, no warmup
