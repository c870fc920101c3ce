"""Arithmetic task generator, RLDataset validation/tokenization, collate and PromptLoader."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.data import (
    DataError,
    PromptLoader,
    RLDataset,
    collate,
    make_arithmetic_rows,
    write_arithmetic_parquet,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from fusedrl.utils.tiny_model import build_tokenizer

    cache = tmp_path_factory.getbasetemp() / "fusedrl_test_tokenizer"
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    return build_tokenizer(cache)


def _write(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def _row(content="What is 1 + 2? Answer with the number.", gt="3", index=0):
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"index": index},
    }


def _encode_chat(tokenizer, content):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- arithmetic generator
def test_arithmetic_rows_schema():
    rows = make_arithmetic_rows(50, seed=3, max_digits=2, ops=("+", "-"), split="train")
    assert len(rows) == 50
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "arithmetic" and row["ability"] == "math"
        info = row["extra_info"]
        assert info["split"] == "train" and info["index"] == i
        a, b, op = info["a"], info["b"], info["op"]
        assert 0 <= a <= 99 and 0 <= b <= 99 and op in ("+", "-")
        assert row["prompt"] == [
            {"role": "user", "content": f"What is {a} {op} {b}? Answer with the number."}
        ]
        expected = a + b if op == "+" else a - b
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(expected)}
    assert len({r["prompt"][0]["content"] for r in rows}) == 50  # no duplicate problems


def test_arithmetic_rows_deterministic():
    assert make_arithmetic_rows(40, seed=7) == make_arithmetic_rows(40, seed=7)
    assert make_arithmetic_rows(40, seed=7) != make_arithmetic_rows(40, seed=8)
    # A prefix does not depend on how many rows are drawn.
    assert make_arithmetic_rows(40, seed=7)[:10] == make_arithmetic_rows(10, seed=7)


def test_arithmetic_rows_digits_and_ops():
    rows = make_arithmetic_rows(30, seed=0, min_digits=3, max_digits=3, ops=("*",))
    for row in rows:
        info = row["extra_info"]
        assert 100 <= info["a"] <= 999 and 100 <= info["b"] <= 999
        assert row["reward_model"]["ground_truth"] == str(info["a"] * info["b"])
    with pytest.raises(ValueError, match="only 200 exist"):
        make_arithmetic_rows(201, seed=0, max_digits=1)
    with pytest.raises(ValueError, match="unsupported ops"):
        make_arithmetic_rows(3, seed=0, ops=("/",))


def test_write_arithmetic_parquet_disjoint(tmp_path):
    train_path, test_path = write_arithmetic_parquet(tmp_path, n_train=150, n_test=40, seed=1)
    assert os.path.basename(train_path) == "train.parquet" and os.path.basename(test_path) == "test.parquet"
    train = pq.read_table(train_path).to_pylist()
    test = pq.read_table(test_path).to_pylist()
    assert len(train) == 150 and len(test) == 40
    assert train == make_arithmetic_rows(150, seed=1)
    assert [r["extra_info"]["split"] for r in test] == ["test"] * 40
    assert [r["extra_info"]["index"] for r in test] == list(range(40))
    train_prompts = {r["prompt"][0]["content"] for r in train}
    test_prompts = {r["prompt"][0]["content"] for r in test}
    assert not train_prompts & test_prompts


def test_preprocess_cli(tmp_path):
    script = os.path.join(REPO, "examples", "data_preprocess", "arithmetic.py")
    args = ["--local_dir", str(tmp_path), "--train_size", "20", "--test_size", "5", "--max_digits", "1"]
    run = subprocess.run([sys.executable, script, *args], check=True, capture_output=True, text=True)
    out = run.stdout.split()
    assert out == [str(tmp_path / "train.parquet"), str(tmp_path / "test.parquet")]
    assert pq.read_table(out[1]).num_rows == 5


# ---------------------------------------------------------------- RLDataset
def test_dataset_items_and_left_padding(tmp_path, tokenizer):
    contents = ["What is 1 + 2? Answer with the number.", "Hi", "Compute 12 - 7 please, step by step."]
    path = _write(
        tmp_path / "mini.parquet", [_row(c, gt=str(i), index=10 + i) for i, c in enumerate(contents)]
    )
    ds = RLDataset(path, tokenizer, max_prompt_length=64)
    assert len(ds) == 3 and ds.num_filtered == 0

    expected = [_encode_chat(tokenizer, c) for c in contents]
    item = ds[0]
    assert item["prompt_ids"] == expected[0]
    assert tokenizer.decode(item["prompt_ids"]) == (
        "<|im_start|>user\nWhat is 1 + 2? Answer with the number.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert item["data_source"] == "arithmetic" and item["ground_truth"] == "0"
    assert item["extra_info"] == {"index": 10}
    assert [ds[i]["uid"] for i in range(3)] == ["mini-0", "mini-1", "mini-2"]

    pad = tokenizer.pad_token_id
    batch = collate([ds[i] for i in range(3)], pad_token_id=pad, max_prompt_length=64)
    assert isinstance(batch, RolloutBatch)
    assert batch.prompts.shape == (3, 64) and batch.prompts.dtype == torch.long
    assert batch.prompt_mask.dtype == torch.long
    for r, ids in enumerate(expected):
        n = len(ids)
        assert batch.prompts[r, 64 - n :].tolist() == ids
        assert batch.prompts[r, : 64 - n].tolist() == [pad] * (64 - n)
        assert batch.prompt_mask[r].tolist() == [0] * (64 - n) + [1] * n
    assert batch.field_list("uid") == ["mini-0", "mini-1", "mini-2"]
    assert batch.field_list("ground_truth") == ["0", "1", "2"]
    assert batch.field_list("data_source") == ["arithmetic"] * 3
    assert batch.field_list("extra_info") == [{"index": 10}, {"index": 11}, {"index": 12}]


def test_dataset_uid_stable_and_multi_file(tmp_path, tokenizer):
    a = _write(tmp_path / "a.parquet", [_row(index=i) for i in range(3)])
    b = _write(tmp_path / "b.parquet", [_row("Hi", index=i) for i in range(2)])
    ds1 = RLDataset([a, b], tokenizer, max_prompt_length=64)
    ds2 = RLDataset([a, b], tokenizer, max_prompt_length=64)
    uids = [ds1[i]["uid"] for i in range(len(ds1))]
    assert uids == ["a-0", "a-1", "a-2", "b-0", "b-1"]
    assert uids == [ds2[i]["uid"] for i in range(len(ds2))]
    # Same stem in two folders: still unique.
    os.makedirs(tmp_path / "x")
    os.makedirs(tmp_path / "y")
    x = _write(tmp_path / "x" / "train.parquet", [_row()])
    y = _write(tmp_path / "y" / "train.parquet", [_row()])
    ds3 = RLDataset([x, y], tokenizer, max_prompt_length=64)
    assert len({ds3[0]["uid"], ds3[1]["uid"]}) == 2
    # Repeating a collated batch keeps the uid of each prompt on all its samples.
    batch = collate([ds1[0], ds1[3]], tokenizer.pad_token_id, 64).repeat_samples(2)
    assert batch.field_list("uid") == ["a-0", "a-0", "b-0", "b-0"]


def test_dataset_reads_arithmetic_files(tmp_path, tokenizer):
    train_path, _ = write_arithmetic_parquet(tmp_path, n_train=32, n_test=8, seed=0)
    ds = RLDataset(train_path, tokenizer, max_prompt_length=64)
    assert len(ds) == 32
    rows = make_arithmetic_rows(32, seed=0)
    assert ds[5]["ground_truth"] == rows[5]["reward_model"]["ground_truth"]
    assert ds[5]["prompt_ids"] == _encode_chat(tokenizer, rows[5]["prompt"][0]["content"])
    assert ds[5]["extra_info"] == rows[5]["extra_info"]


def test_corrupt_parquet(tmp_path, tokenizer):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(DataError, match="broken.parquet") as info:
        RLDataset(str(path), tokenizer, max_prompt_length=64)
    assert "parquet" in str(info.value)
    with pytest.raises(DataError, match="not found"):
        RLDataset(str(tmp_path / "nope.parquet"), tokenizer, max_prompt_length=64)


def test_missing_column(tmp_path, tokenizer):
    rows = [
        {"data_source": "arithmetic", "question": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}
    ]
    path = _write(tmp_path / "nocol.parquet", rows)
    with pytest.raises(DataError) as info:
        RLDataset(path, tokenizer, max_prompt_length=64)
    msg = str(info.value)
    assert "nocol.parquet" in msg and "'prompt'" in msg and "question" in msg and "prompt_key" in msg
    # The configured prompt_key is honoured.
    rows = [
        {
            "data_source": "arithmetic",
            "messages": [{"role": "user", "content": "Hi"}],
            "reward_model": {"ground_truth": "2"},
        }
    ]
    ds = RLDataset(
        _write(tmp_path / "key.parquet", rows), tokenizer, max_prompt_length=64, prompt_key="messages"
    )
    assert len(ds) == 1


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"prompt": []}, "empty list"),
        ({"prompt": [{"role": "user", "content": ""}]}, "empty content"),
        ({"prompt": [{"role": "user", "content": "   "}]}, "empty content"),
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "ground_truth"),
    ],
)
def test_bad_rows(tmp_path, tokenizer, bad, needle):
    rows = [_row(index=i) for i in range(4)]
    rows[2] = {**rows[2], **bad}
    schema = pa.Table.from_pylist([_row()]).schema  # keep column types when a row holds an empty list
    path = _write(tmp_path / "badrow.parquet", rows, schema=schema)
    with pytest.raises(DataError) as info:
        RLDataset(path, tokenizer, max_prompt_length=64)
    msg = str(info.value)
    assert "badrow.parquet" in msg and "row 2" in msg and needle in msg
    assert "row 0" not in msg and "row 1" not in msg


def test_prompt_not_a_message_list(tmp_path, tokenizer):
    rows = [{"data_source": "x", "prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}]
    with pytest.raises(DataError, match=r"(?s)plain\.parquet: 1 bad row.*row 0: .*plain string"):
        RLDataset(_write(tmp_path / "plain.parquet", rows), tokenizer, max_prompt_length=64)


def _long_rows():
    long = "add " * 200 + "1 and 2"
    return [_row(index=0), _row(long, index=1), _row(index=2)]


def test_overlong_prompt_error(tmp_path, tokenizer):
    path = _write(tmp_path / "long.parquet", _long_rows())
    with pytest.raises(DataError) as info:
        RLDataset(path, tokenizer, max_prompt_length=48, truncation="error")
    msg = str(info.value)
    assert "long.parquet" in msg and "row 1" in msg and "max_prompt_length=48" in msg
    # verl's defaults (no filtering, truncation=error): never drop silently, raise instead.
    with pytest.raises(DataError, match="row 1"):
        RLDataset(path, tokenizer, max_prompt_length=48)


def test_overlong_prompt_filter(tmp_path, tokenizer, caplog):
    path = _write(tmp_path / "long.parquet", _long_rows())
    with caplog.at_level(logging.WARNING, logger="fusedrl.data.dataset"):
        ds = RLDataset(path, tokenizer, max_prompt_length=48, filter_overlong_prompts=True)
    assert ds.num_filtered == 1 and len(ds) == 2
    assert [ds[i]["uid"] for i in range(2)] == ["long-0", "long-2"]  # uids keep the file row
    assert "dropped 1 of 3" in caplog.text
    # Everything filtered is an error, not an empty dataset.
    with pytest.raises(DataError, match="no usable prompts"):
        RLDataset(path, tokenizer, max_prompt_length=4, filter_overlong_prompts=True)
    # Filtering wins over truncation (verl drops over-long prompts before the loader truncates anything).
    ds = RLDataset(path, tokenizer, max_prompt_length=48, filter_overlong_prompts=True, truncation="left")
    assert len(ds) == 2 and ds.num_truncated == 0


def test_overlong_prompt_truncate(tmp_path, tokenizer):
    path = _write(tmp_path / "long.parquet", _long_rows())
    full = _encode_chat(tokenizer, _long_rows()[1]["prompt"][0]["content"])
    left = RLDataset(path, tokenizer, max_prompt_length=48, truncation="left")
    right = RLDataset(path, tokenizer, max_prompt_length=48, truncation="right")
    middle = RLDataset(path, tokenizer, max_prompt_length=47, truncation="middle")
    assert len(left) == 3 and left.num_truncated == 1
    assert left[1]["prompt_ids"] == full[-48:] and right[1]["prompt_ids"] == full[:48]
    assert middle[1]["prompt_ids"] == full[:23] + full[-24:]  # 47 // 2 = 23 from the start, 24 from the end
    assert middle[0]["prompt_ids"] == _encode_chat(tokenizer, _long_rows()[0]["prompt"][0]["content"])


def test_truncate_ids_by_hand():
    from fusedrl.data.dataset import truncate_ids

    ids = [1, 2, 3, 4, 5, 6, 7]
    assert truncate_ids(ids, 4, "left") == [4, 5, 6, 7]
    assert truncate_ids(ids, 4, "right") == [1, 2, 3, 4]
    assert truncate_ids(ids, 4, "middle") == [1, 2, 6, 7]
    assert truncate_ids(ids, 5, "middle") == [1, 2, 5, 6, 7]
    assert truncate_ids(ids, 9, "middle") == ids


# ---------------------------------------------------------------- PromptLoader
@pytest.fixture(scope="module")
def arith_dataset(tmp_path_factory, tokenizer):
    train_path, _ = write_arithmetic_parquet(tmp_path_factory.mktemp("arith"), n_train=20, n_test=4, seed=0)
    return RLDataset(train_path, tokenizer, max_prompt_length=40)


def _uids(loader):
    return [batch.field_list("uid") for batch in loader]


def test_loader_shapes_and_len(arith_dataset, tokenizer):
    loader = PromptLoader(
        arith_dataset, batch_size=6, seed=0, pad_token_id=tokenizer.pad_token_id, max_prompt_length=40
    )
    assert len(loader) == 3  # 20 // 6 with drop_last
    batches = list(loader)
    assert len(batches) == 3
    assert all(b.prompts.shape == (6, 40) for b in batches)
    seen = [u for b in batches for u in b.field_list("uid")]
    assert len(set(seen)) == 18
    keep = PromptLoader(arith_dataset, batch_size=6, drop_last=False, shuffle=False)
    assert len(keep) == 4
    sizes = [b.num_samples for b in keep]
    assert sizes == [6, 6, 6, 2]
    # Defaults come from the dataset.
    assert keep.pad_token_id == tokenizer.pad_token_id and keep.max_prompt_length == 40


def test_loader_deterministic_and_epochs_differ(arith_dataset):
    a = PromptLoader(arith_dataset, batch_size=5, seed=3)
    b = PromptLoader(arith_dataset, batch_size=5, seed=3)
    a0, a1 = _uids(a), _uids(a)
    b0, b1 = _uids(b), _uids(b)
    assert a0 == b0 and a1 == b1
    assert a0 != a1  # each epoch has its own permutation
    assert sorted(sum(a0, [])) == sorted(sum(a1, []))
    assert a.state_dict() == {"epoch": 2, "index_in_epoch": 0}
    c = PromptLoader(arith_dataset, batch_size=5, seed=4)
    assert _uids(c) != a0
    ordered = PromptLoader(arith_dataset, batch_size=5, shuffle=False)
    assert sum(_uids(ordered), []) == [arith_dataset[i]["uid"] for i in range(20)]


def test_loader_resume(arith_dataset):
    ref = PromptLoader(arith_dataset, batch_size=4, seed=11)
    full = [_uids(ref) for _ in range(3)]  # 3 epochs x 5 batches

    run = PromptLoader(arith_dataset, batch_size=4, seed=11)
    _uids(run)  # epoch 0
    it = iter(run)
    first = [next(it).field_list("uid") for _ in range(2)]  # two batches of epoch 1
    assert first == full[1][:2]
    state = run.state_dict()
    assert state == {"epoch": 1, "index_in_epoch": 2}

    resumed = PromptLoader(arith_dataset, batch_size=4, seed=11)
    resumed.load_state_dict(state)
    assert _uids(resumed) == full[1][2:]  # rest of epoch 1
    assert _uids(resumed) == full[2]  # then epoch 2 from its start
    # Batches are identical tensors too, not only the same uids.
    again = PromptLoader(arith_dataset, batch_size=4, seed=11)
    again.load_state_dict(state)
    x = next(iter(again))
    fresh = PromptLoader(arith_dataset, batch_size=4, seed=11)
    list(fresh)  # epoch 0
    expected = list(fresh)[2]  # epoch 1, batch 2
    assert torch.equal(x.prompts, expected.prompts) and torch.equal(x.prompt_mask, expected.prompt_mask)

    with pytest.raises(ValueError, match="invalid"):
        resumed.load_state_dict({"epoch": 0, "index_in_epoch": 99})
    with pytest.raises(ValueError, match="lacks"):
        resumed.load_state_dict({"epoch": 0})


def test_loader_batch_size_too_large(arith_dataset):
    with pytest.raises(DataError, match=r"data\.train_batch_size=64.*20 prompts"):
        PromptLoader(arith_dataset, batch_size=64)
