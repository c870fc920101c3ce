"""Ragged rows (`fusedrl.ragged`) and the generation request built on them (`fusedrl.rollout_request`):
a padded field and its mask cross as one tensor and come back bit for bit; the worker's seeds equal the
driver's; the counts of `TensorTraffic` (no Ray needed)."""

from __future__ import annotations

import pickle

import pytest
import torch

from fusedrl.batch import RolloutBatch, split_for_ranks
from fusedrl.controller.worker_group import TensorTraffic, WorkerGroup, tensors_in
from fusedrl.ragged import RaggedRows, pack
from fusedrl.rollout_request import (
    RequestShard,
    RolloutRequest,
    SeedRows,
    expand_answer,
    request_batch,
    wire_answer,
)
from fusedrl.trainer.step_plan import sample_seeds

pytestmark = pytest.mark.unit

PAD = 7


def _left_padded(lengths: list[int], width: int, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, ...]:
    values = torch.full((len(lengths), width), PAD, dtype=dtype)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if n:
            values[i, width - n :] = torch.arange(100 + 10 * i, 100 + 10 * i + n, dtype=dtype)
            mask[i, width - n :] = 1
    return values, mask


def _right_padded(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, mask = _left_padded(lengths, width)
    return values.flip(1), mask.flip(1)  # the same rows, padded on the other side


def test_round_trip_left_and_right_padding_is_bit_identical():
    values, mask = _left_padded([3, 1, 5, 2], 6)
    packed = pack(values, mask, left=True, mask_name="prompt_mask")
    assert packed is not None
    # The lengths, then each row's tokens in order: 4 + 11 numbers, one tensor.
    assert packed.packed.tolist() == [3, 1, 5, 2, 100, 101, 102, 110, 120, 121, 122, 123, 124, 130, 131]
    out_values, out_mask = packed.unpack()
    assert torch.equal(out_values, values) and torch.equal(out_mask, mask)
    assert out_mask.dtype == mask.dtype and packed.pad == PAD and packed.mask == "prompt_mask"

    values, mask = _right_padded([3, 1, 5, 2], 6)
    packed = pack(values, mask, left=False, mask_name="response_mask")
    assert packed is not None
    assert packed.packed[4:7].tolist() == [102, 101, 100]  # row 0 reads left to right
    out_values, out_mask = packed.unpack()
    assert torch.equal(out_values, values) and torch.equal(out_mask, mask)


def test_empty_rows_one_row_and_no_rows():
    values, mask = _left_padded([0, 4, 0], 4)
    packed = pack(values, mask, left=True, mask_name="m")
    assert packed is not None and packed.lengths.tolist() == [0, 4, 0]
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(), (values, mask)))

    values, mask = _right_padded([2], 5)  # one row
    packed = pack(values, mask, left=False, mask_name="m")
    assert packed is not None and packed.rows == 1 and packed.packed.numel() == 1 + 2
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(), (values, mask)))

    values, mask = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)  # no rows
    packed = pack(values, mask, left=False, mask_name="m")
    assert packed is not None
    out_values, out_mask = packed.unpack()
    assert out_values.shape == (0, 3) and out_mask.shape == (0, 3)


def test_width_and_dtypes_are_kept():
    # Every row shorter than the batch's width: the width is the batch's, not the longest row's.
    values, mask = _right_padded([1, 2], 8)
    packed = pack(values, mask, left=False, mask_name="m")
    assert packed is not None
    assert packed.unpack()[0].shape == (2, 8)

    values, mask = _left_padded([1, 3], 4, dtype=torch.int32)
    bool_mask = mask.bool()
    packed = pack(values, bool_mask, left=True, mask_name="m")
    assert packed is not None and packed.packed.dtype == torch.int32
    out_values, out_mask = packed.unpack()
    assert out_values.dtype == torch.int32 and out_mask.dtype == torch.bool
    assert torch.equal(out_values, values) and torch.equal(out_mask, bool_mask)

    # No padding anywhere: any pad id rebuilds it.
    full = torch.arange(6).view(2, 3)
    packed = pack(full, torch.ones(2, 3, dtype=torch.long), left=True, mask_name="m")
    assert packed is not None and torch.equal(packed.unpack()[0], full)


def test_not_packed_where_the_encoding_would_not_be_exact():
    values, mask = _right_padded([3, 2], 5)
    holes = mask.clone()
    holes[0, 1] = 0  # a multi-turn observation token inside the response
    assert pack(values, holes, left=False, mask_name="m") is None
    assert pack(values, mask, left=True, mask_name="m") is None  # the wrong side
    mixed = values.clone()
    mixed[1, 4] = PAD + 1  # two different ids in the padding
    assert pack(mixed, mask, left=False, mask_name="m") is None
    twos = mask * 2  # a mask that is not 0 / 1
    assert pack(values, twos, left=False, mask_name="m") is None
    with pytest.raises(ValueError, match="integers"):
        pack(values.float(), mask, left=False, mask_name="m")
    with pytest.raises(ValueError, match="one \\[B, T\\]"):
        pack(values, mask[:, :2], left=False, mask_name="m")


def test_packed_rows_pickle_and_count_as_one_tensor_with_their_lengths():
    values, mask = _right_padded([3, 0, 2], 4)
    packed = pack(values, mask, left=False, mask_name="response_mask")
    assert packed is not None
    again = pickle.loads(pickle.dumps(packed))
    assert isinstance(again, RaggedRows) and all(
        torch.equal(a, b) for a, b in zip(again.unpack(), (values, mask))
    )
    traffic = TensorTraffic()
    traffic.add([{"responses": packed, "rollout_log_probs": torch.zeros(3, 4)}], "gen back")
    assert traffic.by_call == {"gen back": 2}
    assert traffic.bytes == (3 + 5) * 8 + 3 * 4 * 4  # lengths + tokens, then the log-probs


def _request(
    lengths: list[int], width: int = 6, multi_turn: bool = False
) -> tuple[RolloutBatch, RolloutRequest]:
    prompts, mask = _left_padded(lengths, width)
    batch = RolloutBatch.from_prompts(
        prompts,
        mask,
        uid=[f"u{i}" for i in range(len(lengths))],
        data_source=["d"] * len(lengths),
        ground_truth=[str(i) for i in range(len(lengths))],
    )
    batch.sample_seeds = sample_seeds(3, 5, 2, batch.num_samples)
    names = ("prompts", "prompt_mask", *(("uid", "data_source") if multi_turn else ()))
    return batch, RolloutRequest(batch.select_fields(*names), names, SeedRows(3, 5, 2, batch.num_samples))


@pytest.mark.parametrize("engines", [1, 2, 3])
def test_request_shards_rebuild_the_split_rows_and_their_seeds(engines):
    # 5 rows on 2 or 3 engines: the split pads with the first rows again, whose seeds are those rows' seeds.
    batch, request = _request([2, 6, 1, 4, 3], multi_turn=True)
    shards = request.shards_for(engines)
    expected, _ = split_for_ranks(batch, engines)
    assert [s.rows for s in shards] == [e.num_samples for e in expected]
    for shard, want in zip(shards, expected):
        assert isinstance(shard, RequestShard) and shard.prompts is not None
        got = request_batch(shard)
        for name in ("prompts", "prompt_mask", "sample_seeds"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert getattr(got, name).dtype == getattr(want, name).dtype
        assert got.field_list("uid") == want.field_list("uid")
        assert got.responses is None and got.ground_truth is None  # only what was named
    # What crosses: one tensor per engine (the packed prompts); the seeds are plain ints.
    assert [len(tensors_in(s)) for s in shards] == [1] * engines
    assert request.num_samples == 5 and WorkerGroup.split_pad(request, engines) == (-5) % engines


def test_request_sends_padded_prompts_where_they_cannot_be_packed():
    batch, _ = _request([2, 3])
    batch.prompt_mask[0, -1] = 0  # a hole: not a left padding
    names = ("prompts", "prompt_mask")
    (shard,) = RolloutRequest(batch.select_fields(*names), names, SeedRows(3, 5, 2, 2)).shards_for(1)
    assert shard.prompts is None and len(tensors_in(shard)) == 2
    got = shard.batch()
    assert torch.equal(got.prompt_mask, batch.prompt_mask) and torch.equal(
        got.sample_seeds, batch.sample_seeds
    )


def test_a_batch_sent_whole_keeps_its_explicit_seeds():
    batch, _ = _request([2, 3])
    batch.sample_seeds = torch.tensor([11, 12])
    assert request_batch(batch) is batch


def test_single_turn_answers_cross_packed_and_multi_turn_answers_padded():
    responses, mask = _right_padded([3, 0, 4], 5)
    log_probs = -torch.rand(3, 5) * mask
    answer = {"responses": responses, "response_mask": mask, "rollout_log_probs": log_probs}
    wire = wire_answer(answer)
    assert set(wire) == {"responses", "rollout_log_probs"} and isinstance(wire["responses"], RaggedRows)
    back = expand_answer(wire)
    assert set(back) == set(answer) and all(torch.equal(back[k], answer[k]) for k in answer)

    multi = {**answer, "response_attention_mask": torch.ones_like(mask)}
    assert wire_answer(multi).keys() == multi.keys()  # an answer with observation tokens stays padded
    holes = mask.clone()
    holes[0, 1] = 0
    assert wire_answer({**answer, "response_mask": holes})["response_mask"] is holes


def test_gather_fields_unpacks_each_engine_and_drops_the_split_padding():
    # Two engines answer 2 rows each for a 3-row call; one could not pack its answer (counted as 2 tensors).
    responses, mask = _right_padded([1, 2, 3, 1], 4)
    parts = [
        wire_answer({"responses": responses[:2], "response_mask": mask[:2]}),
        {"responses": responses[2:], "response_mask": mask[2:]},
    ]
    traffic = TensorTraffic()
    traffic.add(parts, "gen back")
    assert traffic.crossings == 2  # the most any engine sent
    _, request = _request([1, 1, 1])
    group = WorkerGroup.__new__(WorkerGroup)  # gathering needs no workers
    out = group.gather_fields(parts, request)
    assert torch.equal(out["responses"], responses[:3]) and torch.equal(out["response_mask"], mask[:3])


def test_worker_seeds_equal_the_drivers_for_any_first_row():
    full = sample_seeds(9, 4, -1, 7)  # ReMax's greedy round is -1
    for first in range(7):
        rows = 7 - first
        assert torch.equal(SeedRows(9, 4, -1, 7, first).seeds(rows), full[first:])
    assert torch.equal(SeedRows(9, 4, -1, 7, 6).seeds(3), full[[6, 0, 1]])  # a split's padding wraps round
