"""RolloutBatch: construction, reshaping across ranks, field selection and the causal-LM view.

Every expectation is small enough to check by hand. Rows are made distinguishable (prompt row ``i`` holds
``100 * i + column``, uids ``p{i}``, one dict per row in extra_info) so a wrong row order shows up.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from fusedrl.batch import (
    NON_TENSOR_FIELDS,
    RolloutBatch,
    concat,
    gather_from_ranks,
    pad_to_multiple,
    split_for_ranks,
    unpad,
)

TP, TR = 4, 3  # prompt / response widths used throughout

TENSOR_FIELDS = (
    "prompts",
    "prompt_mask",
    "responses",
    "response_mask",
    "rollout_log_probs",
    "token_level_scores",
    "token_level_rewards",
    "old_log_probs",
    "ref_log_probs",
    "critic_values",
    "advantages",
    "returns",
)


def make_batch(b: int, offset: int = 0) -> RolloutBatch:
    """``b`` prompt-only rows; row ``i`` is recognisable by ``offset + i`` in every field."""
    rows = [offset + i for i in range(b)]
    prompts = torch.tensor([[100 * r + c for c in range(TP)] for r in rows], dtype=torch.long).reshape(b, TP)
    prompt_mask = torch.ones(b, TP, dtype=torch.long)
    return RolloutBatch.from_prompts(
        prompts,
        prompt_mask,
        uid=[f"p{r}" for r in rows],
        data_source=["arith" if r % 2 == 0 else "gsm8k" for r in rows],
        ground_truth=[str(r * 7) for r in rows],
        extra_info=[{"index": r, "split": "train"} for r in rows],
    )


def add_rollout(batch: RolloutBatch) -> RolloutBatch:
    """Fill the response and per-token float fields with row-recognisable values."""
    b = batch.num_samples
    base = batch.prompts[:, :1]  # [B, 1], 100 * row
    batch.responses = base + 10 + torch.arange(TR)  # [B, TR]
    batch.response_mask = torch.ones(b, TR, dtype=torch.long)
    batch.rollout_log_probs = -(base.float() + torch.arange(TR).float()) / 1000
    batch.old_log_probs = batch.rollout_log_probs - 0.5
    batch.ref_log_probs = batch.rollout_log_probs - 0.25
    return batch


def assert_same_batch(actual: RolloutBatch, expected: RolloutBatch) -> None:
    assert actual.num_samples == expected.num_samples
    for name in TENSOR_FIELDS:
        a, e = getattr(actual, name), getattr(expected, name)
        if e is None:
            assert a is None, name
        else:
            assert a is not None, name
            assert a.dtype == e.dtype, name
            assert torch.equal(a, e), name
    for name in NON_TENSOR_FIELDS:
        assert actual.field_list(name) == expected.field_list(name), name


# ---------------------------------------------------------------------- construction


def test_from_prompts_builds_prompt_only_batch():
    batch = make_batch(3)
    assert batch.num_samples == 3
    assert batch.batch_size == torch.Size([3])
    assert batch.prompts.shape == (3, TP)
    assert batch.prompts[2].tolist() == [200, 201, 202, 203]
    assert batch.field_list("uid") == ["p0", "p1", "p2"]
    assert batch.field_list("data_source") == ["arith", "gsm8k", "arith"]
    assert batch.field_list("ground_truth") == ["0", "7", "14"]
    assert batch.field_list("extra_info") == [{"index": i, "split": "train"} for i in range(3)]
    for name in TENSOR_FIELDS[2:]:
        assert getattr(batch, name) is None, name


def test_from_prompts_defaults_and_stringifies():
    batch = RolloutBatch.from_prompts(
        torch.zeros(2, TP, dtype=torch.long),
        torch.ones(2, TP, dtype=torch.long),
        uid=["a", "b"],
        data_source=["s", "s"],
        ground_truth=[3, 4.5],  # non-strings become strings
    )
    assert batch.field_list("ground_truth") == ["3", "4.5"]
    assert batch.field_list("extra_info") == [{}, {}]


@pytest.mark.parametrize("bad_field", ["uid", "data_source", "ground_truth"])
def test_from_prompts_length_mismatch_names_field(bad_field):
    kwargs = {"uid": ["a", "b", "c"], "data_source": ["s"] * 3, "ground_truth": ["1"] * 3}
    kwargs[bad_field] = kwargs[bad_field][:2]
    with pytest.raises(ValueError, match=rf"\b{bad_field}\b has 2 items for 3 prompts"):
        RolloutBatch.from_prompts(
            torch.zeros(3, TP, dtype=torch.long), torch.ones(3, TP, dtype=torch.long), **kwargs
        )


def test_from_prompts_extra_info_length_mismatch_names_field():
    with pytest.raises(ValueError, match="extra_info"):
        RolloutBatch.from_prompts(
            torch.zeros(3, TP, dtype=torch.long),
            torch.ones(3, TP, dtype=torch.long),
            uid=["a", "b", "c"],
            data_source=["s"] * 3,
            ground_truth=["1"] * 3,
            extra_info=[{}, {}],
        )


# ---------------------------------------------------------------------- repeat_samples


def test_repeat_samples_groups_rows():
    batch = add_rollout(make_batch(3))
    rep = batch.repeat_samples(2)
    assert rep.num_samples == 6
    assert rep.prompts[:, 0].tolist() == [0, 0, 100, 100, 200, 200]
    assert rep.responses[:, 0].tolist() == [10, 10, 110, 110, 210, 210]
    assert rep.field_list("uid") == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert rep.field_list("ground_truth") == ["0", "0", "7", "7", "14", "14"]
    assert rep.field_list("extra_info") == [{"index": i, "split": "train"} for i in (0, 0, 1, 1, 2, 2)]
    for k in range(3):  # the two samples of one prompt share their uid and their prompt
        assert rep.field_list("uid")[2 * k] == rep.field_list("uid")[2 * k + 1]
        assert torch.equal(rep.prompts[2 * k], rep.prompts[2 * k + 1])
        assert torch.equal(rep.prompts[2 * k], batch.prompts[k])


def test_repeat_samples_n3():
    rep = make_batch(2).repeat_samples(3)
    assert rep.field_list("uid") == ["p0"] * 3 + ["p1"] * 3
    assert rep.prompts[:, 0].tolist() == [0, 0, 0, 100, 100, 100]


def test_repeat_samples_one_keeps_rows():
    batch = add_rollout(make_batch(3))
    rep = batch.repeat_samples(1)
    assert_same_batch(rep, batch)


# ---------------------------------------------------------------------- ranks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("b", range(1, 8))
@pytest.mark.parametrize("with_rollout", [False, True])
def test_split_gather_round_trip(b, world, with_rollout):
    batch = make_batch(b)
    if with_rollout:
        add_rollout(batch)
    shards, pad = split_for_ranks(batch, world)
    assert pad == (-b) % world
    assert len(shards) == world
    sizes = [s.num_samples for s in shards]
    assert sizes == [(b + pad) // world] * world
    # Contiguous chunks: concatenated in rank order, the shards list the rows 0..B-1 then the padding.
    uids = [u for s in shards for u in s.field_list("uid")]
    assert uids == [f"p{i % b}" for i in range(b + pad)]
    gathered = gather_from_ranks(shards, pad)
    assert_same_batch(gathered, batch)


def test_split_gather_round_trip_after_worker_fills_fields():
    """Workers add fields to their shard; the gathered batch carries them for the original rows only."""
    batch = add_rollout(make_batch(5))
    shards, pad = split_for_ranks(batch, 4)
    assert pad == 3
    for shard in shards:
        shard.advantages = shard.prompts[:, :TR].float() * 2  # [b, TR]
    gathered = gather_from_ranks(shards, pad)
    assert gathered.num_samples == 5
    assert torch.equal(gathered.advantages, batch.prompts[:, :TR].float() * 2)
    assert torch.equal(gathered.old_log_probs, batch.old_log_probs)
    assert gathered.field_list("uid") == batch.field_list("uid")


def test_split_shards_survive_pickle():
    """Ray ships each shard with pickle; the round trip must hold afterwards too."""
    batch = add_rollout(make_batch(5))
    shards, pad = split_for_ranks(batch, 2)
    shipped = [pickle.loads(pickle.dumps(s)) for s in shards]
    assert_same_batch(gather_from_ranks(shipped, pad), batch)


def test_split_shards_pickle_only_their_rows():
    """A shard crosses Ray with only its own rows: a slice pickles its parent's whole storage, so without a
    copy every rank of 4 would be sent the whole batch (measured on the pickled bytes, as Ray ships them)."""
    batch = make_batch(64)
    batch.responses = torch.zeros(64, 4096, dtype=torch.long)  # 2 MiB: dominates the pickle
    whole = len(pickle.dumps(batch))
    shards, _ = split_for_ranks(batch, 4)
    sizes = [len(pickle.dumps(s)) for s in shards]
    assert all(size < whole / 4 + 64 * 1024 for size in sizes), (sizes, whole)
    assert_same_batch(gather_from_ranks(shards, 0), batch)


# ---------------------------------------------------------------------- padding


def test_pad_to_multiple_repeats_first_rows():
    batch = add_rollout(make_batch(5))
    padded, pad = pad_to_multiple(batch, 4)
    assert pad == 3
    assert padded.num_samples == 8
    assert_same_batch(padded[:5], batch)
    assert_same_batch(padded[5:], batch[:3])  # rows 0, 1, 2 again
    assert padded.field_list("uid") == ["p0", "p1", "p2", "p3", "p4", "p0", "p1", "p2"]
    assert_same_batch(unpad(padded, pad), batch)


def test_pad_to_multiple_wraps_when_pad_exceeds_rows():
    batch = make_batch(2)
    padded, pad = pad_to_multiple(batch, 5)
    assert pad == 3
    assert padded.field_list("uid") == ["p0", "p1", "p0", "p1", "p0"]
    assert padded.prompts[:, 0].tolist() == [0, 100, 0, 100, 0]
    assert_same_batch(unpad(padded, pad), batch)


def test_pad_to_multiple_noop_when_divisible():
    batch = make_batch(6)
    padded, pad = pad_to_multiple(batch, 3)
    assert pad == 0
    assert padded is batch
    assert unpad(padded, 0) is batch


# ---------------------------------------------------------------------- concat / select / update


def test_concat_keeps_order():
    parts = [add_rollout(make_batch(2, 0)), add_rollout(make_batch(1, 2)), add_rollout(make_batch(3, 3))]
    out = concat(parts)
    assert_same_batch(out, add_rollout(make_batch(6)))
    assert out.field_list("uid") == [f"p{i}" for i in range(6)]
    assert out.prompts[:, 0].tolist() == [0, 100, 200, 300, 400, 500]


def test_concat_of_nothing_raises():
    with pytest.raises(ValueError):
        concat([])


def test_select_fields_keeps_only_named():
    batch = add_rollout(make_batch(3))
    batch.advantages = torch.ones(3, TR)
    sel = batch.select_fields("responses", "response_mask", "old_log_probs", "uid")
    assert sel.num_samples == 3
    assert torch.equal(sel.responses, batch.responses)
    assert torch.equal(sel.response_mask, batch.response_mask)
    assert torch.equal(sel.old_log_probs, batch.old_log_probs)
    assert sel.field_list("uid") == ["p0", "p1", "p2"]
    # prompts / prompt_mask are the tensorclass's required fields and always ride along.
    assert torch.equal(sel.prompts, batch.prompts)
    for name in ("rollout_log_probs", "ref_log_probs", "advantages", "token_level_scores", "critic_values"):
        assert getattr(sel, name) is None, name
    for name in ("data_source", "ground_truth", "extra_info"):
        assert getattr(sel, name) is None, name
    # The source batch is untouched.
    assert batch.ref_log_probs is not None
    assert batch.field_list("ground_truth") == ["0", "7", "14"]


def test_select_fields_non_tensor_survives_pickle():
    sel = make_batch(3).select_fields("prompts", "prompt_mask", "extra_info")
    back = pickle.loads(pickle.dumps(sel))
    assert back.field_list("extra_info") == [{"index": i, "split": "train"} for i in range(3)]
    assert back.uid is None


def test_select_fields_rejects_unset_field():
    batch = make_batch(3)
    with pytest.raises(ValueError, match="responses"):
        batch.select_fields("prompts", "responses")


def test_update_from_copies_fields_in_place():
    batch = add_rollout(make_batch(3))
    worker_out = batch.select_fields("responses")
    worker_out.old_log_probs = torch.full((3, TR), -1.5)
    worker_out.ref_log_probs = torch.full((3, TR), -2.5)
    before_rollout = batch.rollout_log_probs.clone()
    result = batch.update_from(worker_out, "old_log_probs", "ref_log_probs")
    assert result is batch
    assert torch.equal(batch.old_log_probs, torch.full((3, TR), -1.5))
    assert torch.equal(batch.ref_log_probs, torch.full((3, TR), -2.5))
    assert torch.equal(batch.rollout_log_probs, before_rollout)  # not named, not touched
    assert batch.field_list("uid") == ["p0", "p1", "p2"]


def test_update_from_rejects_different_row_count():
    batch = add_rollout(make_batch(3))
    with pytest.raises(ValueError, match="2 rows vs 3"):
        batch.update_from(batch[:2], "old_log_probs")


# ---------------------------------------------------------------------- sequences


def test_sequences_left_padded_prompts_right_padded_responses():
    batch = RolloutBatch.from_prompts(
        torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
        torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        uid=["a", "b"],
        data_source=["s", "s"],
        ground_truth=["1", "2"],
    )
    batch.responses = torch.tensor([[11, 12, 0], [13, 0, 0]])
    batch.response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    input_ids, attention_mask, position_ids = batch.sequences()

    assert input_ids.tolist() == [[0, 0, 5, 6, 11, 12, 0], [7, 8, 9, 10, 13, 0, 0]]
    assert attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]]
    assert attention_mask.dtype == torch.long
    # Real tokens are numbered 0, 1, 2, ... regardless of the left padding: row 0's prompt 5, 6 sits at 0, 1
    # and its response 11, 12 at 2, 3. Left padding gets 0; right padding repeats the last real position
    # (verl's convention: clamp(cumsum(mask) - 1, min=0)); both are masked out anyway.
    assert position_ids.tolist() == [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 4, 4]]
    # The positions of real tokens are what an unpadded forward pass would use.
    for row in range(2):
        real = attention_mask[row].bool()
        assert position_ids[row][real].tolist() == list(range(int(real.sum())))


def test_sequences_without_responses_raises():
    batch = make_batch(2)
    with pytest.raises(ValueError, match="no responses"):
        batch.sequences()
    batch.responses = torch.zeros(2, TR, dtype=torch.long)  # mask still missing
    with pytest.raises(ValueError, match="no responses"):
        batch.sequences()


# ---------------------------------------------------------------------- pickling


def test_pickle_round_trip_keeps_all_fields():
    batch = add_rollout(make_batch(4))
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, RolloutBatch)
    assert_same_batch(back, batch)
    assert back.field_list("extra_info") == [{"index": i, "split": "train"} for i in range(4)]
    # Indexing still works on the unpickled batch (the stacked non-tensor fields stayed per-row).
    assert back[1:3].field_list("uid") == ["p1", "p2"]
