"""The per-step decisions of the PPO loop (`fusedrl.trainer.step_plan`) and the last-token placement of
sequence rewards, checked by hand."""

from __future__ import annotations

import torch

from fusedrl.batch import last_sampled_index, on_last_sampled_token
from fusedrl.trainer.step_plan import due, sample_seeds


def test_due_every_freq_and_at_the_end():
    assert [s for s in range(1, 8) if due(3, s, 7)] == [3, 6, 7]
    assert not any(due(0, s, 7) for s in range(1, 8))
    assert not any(due(-1, s, 7) for s in range(1, 8))


def test_sample_seeds_differ_by_row_step_and_round():
    a = sample_seeds(1, 2, 0, 4)
    assert a.tolist() == [(1 * 1_000_003 + 2 * 10_007 + i * 7919) % (2**31 - 1) for i in range(4)]
    assert not torch.equal(a, sample_seeds(1, 3, 0, 4))
    assert not torch.equal(a, sample_seeds(1, 2, 1, 4))


def test_sequence_value_lands_on_the_last_sampled_token():
    # Row 0: sampled, observation, sampled, padding -> last sampled is position 2; row 1 has none.
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])
    assert last_sampled_index(mask).tolist() == [2, 0]
    out = on_last_sampled_token(torch.tensor([2.5, 7.0]), mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 0.0, 2.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
