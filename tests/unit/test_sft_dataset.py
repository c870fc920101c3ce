"""SFT data: loss mask on exactly the assistant turns, both row forms, named errors, batching helpers.
Also the SFT config validation and LR schedule (pure functions, no Ray)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from fusedrl.data.dataset import DataError
from fusedrl.data.sft_dataset import SFTDataset, SFTLoader, collate, shard_batch

IM_END = "<|im_end|>"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "It is 20."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from fusedrl.utils.tiny_model import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("sft_tok")))


def _write(tmp_path, name: str, rows: list[dict]) -> str:
    path = str(tmp_path / name)
    pd.DataFrame(rows).to_parquet(path)
    return path


def _trained_spans(tokenizer, item: dict) -> list[str]:
    """Decoded runs of consecutive loss-mask-1 tokens."""
    spans, run = [], []
    for tok, m in zip(item["input_ids"], item["loss_mask"]):
        if m:
            run.append(tok)
        elif run:
            spans.append(run)
            run = []
    if run:
        spans.append(run)
    return [tokenizer.decode(s, skip_special_tokens=False) for s in spans]


def test_multi_turn_mask_selects_exactly_the_assistant_turns(tokenizer, tmp_path):
    path = _write(tmp_path, "chat.parquet", [{"messages": CONVERSATION}])
    ds = SFTDataset(path, tokenizer, max_length=256)
    item = ds[0]
    assert _trained_spans(tokenizer, item) == [f"The answer is 5.{IM_END}", f"It is 20.{IM_END}"]
    selected = [t for t, m in zip(item["input_ids"], item["loss_mask"]) if m]
    assert (
        tokenizer.decode(selected, skip_special_tokens=False) == f"The answer is 5.{IM_END}It is 20.{IM_END}"
    )
    # The tokens are the whole rendered conversation, and no role header is trained.
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(item["input_ids"], skip_special_tokens=False) == full
    assert item["input_ids"] == tokenizer(full, add_special_tokens=False)["input_ids"]
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for start in range(len(item["input_ids"]) - len(header) + 1):
        if item["input_ids"][start : start + len(header)] == header:
            assert not any(item["loss_mask"][start : start + len(header)])
    assert item["uid"] == "chat-0"
    assert ds.num_loss_tokens() == sum(item["loss_mask"])


def test_prompt_response_columns(tokenizer, tmp_path):
    rows = [
        {"prompt": "What is 7 + 1?", "response": "The answer is 8."},
        {"prompt": "What is 9 - 4?", "response": "The answer is 5."},
    ]
    ds = SFTDataset(_write(tmp_path, "pairs.parquet", rows), tokenizer, max_length=64)
    assert len(ds) == 2
    assert _trained_spans(tokenizer, ds[1]) == [f"The answer is 5.{IM_END}"]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 9 - 4?"}, {"role": "assistant", "content": "The answer is 5."}],
        tokenize=False,
    )
    assert tokenizer.decode(ds[1]["input_ids"], skip_special_tokens=False) == expected
    # Custom column names.
    renamed = [{"q": r["prompt"], "a": r["response"]} for r in rows]
    ds2 = SFTDataset(_write(tmp_path, "qa.parquet", renamed), tokenizer, 64, prompt_key="q", response_key="a")
    assert ds2[1]["input_ids"] == ds[1]["input_ids"] and ds2[1]["loss_mask"] == ds[1]["loss_mask"]


def test_overlong_row_error_names_file_and_row_and_right_truncation(tokenizer, tmp_path):
    rows = [
        {"prompt": "Hi", "response": "Yes."},
        {"prompt": "What is 1 + 1? " * 20, "response": "The answer is 2."},
    ]
    path = _write(tmp_path, "long.parquet", rows)
    with pytest.raises(DataError) as err:
        SFTDataset(path, tokenizer, max_length=32)
    msg = str(err.value)
    assert "long.parquet" in msg and "row 1" in msg and "data.max_length=32" in msg
    ds = SFTDataset(path, tokenizer, max_length=32, truncation="right")
    assert len(ds[1]["input_ids"]) == 32 and ds.num_truncated == 1
    assert ds.num_without_loss == 1  # the response was cut off entirely


def test_missing_column_and_bad_rows_are_named(tokenizer, tmp_path):
    path = _write(tmp_path, "nocol.parquet", [{"question": "x", "answer": "y"}])
    with pytest.raises(DataError, match=r"nocol\.parquet: missing column.*question"):
        SFTDataset(path, tokenizer, max_length=64)
    bad = [
        {"messages": CONVERSATION},
        {"messages": [{"role": "user", "content": "only a question"}]},
    ]
    with pytest.raises(DataError, match=r"(?s)bad\.parquet: 1 bad row.*row 1: .*no assistant turn"):
        SFTDataset(_write(tmp_path, "bad.parquet", bad), tokenizer, max_length=256)
    empty = [{"prompt": "q", "response": ""}]
    with pytest.raises(DataError, match=r"row 0: column 'response'"):
        SFTDataset(_write(tmp_path, "empty.parquet", empty), tokenizer, max_length=64)


def test_template_without_prefix_property_is_a_named_error(tokenizer, tmp_path):
    """A template that rewrites past assistant turns (here: only the last one keeps its content)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = _write(tmp_path, "rewrite.parquet", [{"messages": CONVERSATION}])
    with pytest.raises(DataError, match=r"(?s)rewrite\.parquet: 1 bad row.*row 0: .*rewrites earlier turns"):
        SFTDataset(path, tok, max_length=256)


def test_collate_shard_and_loader(tokenizer, tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "response": f"The answer is {i + 1}."} for i in range(5)]
    ds = SFTDataset(_write(tmp_path, "five.parquet", rows), tokenizer, max_length=64)
    batch = collate([ds[0], ds[3]], pad_id=ds.pad_token_id)
    lengths = [len(ds[0]["input_ids"]), len(ds[3]["input_ids"])]
    assert batch["input_ids"].shape == (2, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["loss_mask"] <= batch["attention_mask"]).all()

    full = collate([ds[i] for i in range(5)], pad_id=ds.pad_token_id)
    shards = shard_batch(full, 2)  # 5 rows -> 3 + 3, one padding row (a copy of row 0, loss_mask 0)
    assert [s["input_ids"].shape[0] for s in shards] == [3, 3]
    assert torch.equal(shards[1]["input_ids"][-1], full["input_ids"][0])
    assert shards[1]["loss_mask"][-1].sum() == 0
    assert sum(int(s["loss_mask"].sum()) for s in shards) == int(full["loss_mask"].sum())

    loader = SFTLoader(ds, batch_size=2, shuffle=True, seed=3)
    first_epoch = [b["input_ids"] for b in loader]
    assert len(first_epoch) == 2 and loader.state_dict() == {"epoch": 1, "index_in_epoch": 0}
    resumed = SFTLoader(ds, batch_size=2, shuffle=True, seed=3)
    resumed.load_state_dict({"epoch": 0, "index_in_epoch": 1})
    assert torch.equal(next(iter(resumed))["input_ids"], first_epoch[1])


# ---------------------------------------------------------------------- config + LR schedule (no Ray)
def test_lr_schedule():
    from fusedrl.workers.sft_worker import lr_at

    kw = dict(base_lr=1.0, total_steps=10, warmup_steps=2)
    assert [lr_at(s, scheduler="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_at(s, scheduler="cosine", **kw) for s in range(10)]
    assert cos[:3] == [0.5, 1.0, 1.0] and all(a > b for a, b in zip(cos[2:], cos[3:]))
    assert math.isclose(lr_at(10, scheduler="cosine", min_lr_ratio=0.1, **kw), 0.1)


def test_validate_sft_reports_every_problem(tmp_path, tokenizer):
    from fusedrl.config import ConfigError
    from fusedrl.trainer.sft_trainer import load_sft_config

    with pytest.raises(ConfigError) as err:
        load_sft_config(
            [
                f"data.train_files={tmp_path}/nope.parquet",
                f"model.path={tmp_path}",
                "data.train_batch_size=3",
                "optim.lr_scheduler=linear",
                "optim.lr=0",
                "data.truncation=left",
                "data.max_lenght=8",
                "trainer.logger=[console,bogus]",
            ]
        )
    text = "\n".join(err.value.problems)
    for needle in (
        "nope.parquet` does not exist",
        "`model.path`",
        "`data.train_batch_size`=3 does not divide across 2 workers",
        "`optim.lr_scheduler`='linear'",
        "`optim.lr`=0.0",
        "`data.truncation`='left'",
        "`data.max_lenght`: unknown key. Did you mean `data.max_length`?",
        "unknown logger 'bogus'",
    ):
        assert needle in text, (needle, text)
    with pytest.raises(ConfigError, match="data.train_files`: required"):
        load_sft_config([f"model.path={tmp_path}"])


def test_main_sft_exits_2_on_bad_config(tmp_path, capsys):
    from fusedrl.trainer.main_sft import main

    assert main([f"model.path={tmp_path}", "optim.lr_scheduler=step"]) == 2
    err = capsys.readouterr().err
    assert "data.train_files`: required" in err and "`optim.lr_scheduler`='step'" in err


def test_console_line():
    from fusedrl.trainer.sft_trainer import format_sft_console

    line = format_sft_console(
        3, {"train/loss": 1.23456, "train/lr": 1e-4, "val/loss": 2.0}, total_steps=12, eta_s=75
    )
    assert line == "[3/12 25%] step 3 | loss 1.2346 | val_loss 2.0000 | lr 0.0001 | eta 1m15s"
