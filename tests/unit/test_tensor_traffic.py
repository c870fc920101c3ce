"""`TensorTraffic`: one crossing per tensor field per call, bytes over every rank (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.controller.worker_group import TensorTraffic, tensors_in

pytestmark = pytest.mark.unit


def _batch(rows: int) -> RolloutBatch:
    b = RolloutBatch.from_prompts(
        torch.zeros(rows, 4, dtype=torch.long),
        torch.ones(rows, 4, dtype=torch.long),
        uid=[f"u{i}" for i in range(rows)],
        data_source=["x"] * rows,
        ground_truth=["1"] * rows,
    )
    b.responses = torch.zeros(rows, 2, dtype=torch.long)
    return b


def test_tensors_in_batches_pairs_and_metrics():
    assert len(tensors_in(_batch(3))) == 3  # prompts, prompt_mask, responses; strings are not tensors
    assert len(tensors_in(({"loss": 1.0}, torch.zeros(2)))) == 1
    assert tensors_in({"grad_norm": 0.5}) == []


def test_one_crossing_per_field_per_call():
    traffic = TensorTraffic()
    shards = [_batch(2), _batch(2)]  # one call, two ranks
    traffic.add(shards, "rollout_generate out")
    traffic.add([{"loss": 1.0}, {"loss": 2.0}], "actor_update back")  # metrics only: nothing crossed
    assert traffic.crossings == 3
    assert traffic.by_call == {"rollout_generate out": 3}
    assert traffic.bytes == 2 * 2 * (4 + 4 + 2) * 8
