"""The CPU agentic example's pieces (examples/agentic/tool_use_cpu.py): the hidden-table tool loads from its
YAML and answers, the data holds the test rooms out of training (tokenizer corpus included), every SFT
demonstration is about a different room, each tool demonstration's call parses to the tool and its answer is
the ground truth, and the SFT dataset (with the example's tokenizer and max_length) trains on the assistant
turns only, the room's letters being the same tokens in the question and in the call."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agentic"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import tool_use_cpu

        yield tool_use_cpu
    finally:
        sys.path.remove(str(EXAMPLE))


def room_of(text: str) -> str:
    (room,) = re.findall(r'"([A-Z]{3})"', text)
    return room


@pytest.fixture(scope="module")
def data(example, tmp_path_factory):
    return example.write_data(str(tmp_path_factory.mktemp("agentic_data")), seed=0, n_sft=200)


def test_tool_loads_and_refuses_bad_rooms(example):
    from fusedrl.agent import ToolSet, load_tool_config, parse_hermes

    tools = ToolSet(load_tool_config(example.TOOLS_YAML))
    schema = tools.schemas()[0]["function"]
    assert schema["name"] == "lookup" and schema["parameters"]["properties"]["room"]["type"] == "string"
    call = parse_hermes(example.call_text("KQZ"))[0]
    assert call.error is None and call.arguments == {"room": "KQZ"}
    code = tools["lookup"].execute("t", call.arguments)
    assert code == str(example.room_code("KQZ")) and len(code) == 3
    codes = {tools["lookup"].execute("t", {"room": r}) for r in ("AAA", "KQY", "ZZZ", "MOP")}
    assert len(codes) > 1 and all(len(c) == 3 and c.isdigit() for c in codes)  # a table, not a constant
    for bad in ("kqz", "KQ", "KQZA", "K1Z", 482, None):
        with pytest.raises(ValueError, match="room must be three capital letters"):
            tools["lookup"].execute("t", {"room": bad})


def test_test_rooms_are_held_out(example, data):
    def rooms(path, column):
        df = pd.read_parquet(path)
        return [room_of(m[0]["content"]) for m in df[column]]

    test = set(rooms(data["test"], "prompt"))
    assert len(test) == 64
    assert not test & set(rooms(data["train"], "prompt"))
    sft = rooms(data["sft"], "messages")
    assert len(set(sft)) == len(sft) == 200  # one demonstration per room: codes can't be learnt by heart
    assert not test & set(sft)
    assert rooms(data["sft_direct"], "messages") == sft
    corpus_rooms = {
        r for line in example.tokenizer_corpus(0)[-400:] for r in re.findall(r'"([A-Z]{3})"', line)
    }
    assert corpus_rooms and not test & corpus_rooms


def test_demonstrations_call_the_tool_and_copy_its_answer(example, data):
    from fusedrl.agent import parse_hermes

    df = pd.read_parquet(data["sft"])
    used = 0
    for messages in df["messages"]:
        room = room_of(messages[0]["content"])
        if len(messages) == 2:  # the guessing annotator: a made-up code, never the true one
            guess = re.fullmatch(r"I think it is (\d{3})\.", messages[1]["content"])
            assert guess and int(guess.group(1)) != example.room_code(room)
            continue
        used += 1
        (call,) = parse_hermes(messages[1]["content"])
        assert call.name == "lookup" and call.arguments == {"room": room}
        assert messages[2] == {"role": "tool", "content": str(example.room_code(room))}
        assert messages[3]["content"] == f"{example.room_code(room)}."
    assert 0.3 < used / len(df) < 0.7  # half the phrasings use the tool 80% of the time, half 20%


def test_sft_trains_on_assistant_turns_only(example, data, tmp_path):
    from fusedrl.data.sft_dataset import SFTDataset
    from fusedrl.utils.tiny_model import build_tokenizer

    # The example's tokenizer (tool-call text in its corpus) fits every demonstration in data.max_length=96.
    tok = build_tokenizer(tmp_path / "tok", corpus=example.tokenizer_corpus(0))
    df = pd.read_parquet(data["sft"])
    i = next(k for k, m in enumerate(df["messages"]) if len(m) == 4)
    room = room_of(df["messages"][i][0]["content"])
    item = SFTDataset(data["sft"], tok, max_length=96)[i]
    trained = tok.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if m])
    code = example.room_code(room)
    assert trained == f"{example.call_text(room)}<|im_end|>{code}.<|im_end|>"
    # The room's letters are the same tokens in the question and in the call (a plain copy).
    question = tok.encode(df["messages"][i][0]["content"], add_special_tokens=False)
    call = tok.encode(example.call_text(room), add_special_tokens=False)
    letters = tok.encode(room, add_special_tokens=False)

    def holds(seq, sub):
        return any(seq[k : k + len(sub)] == sub for k in range(len(seq)))

    assert holds(question, letters) and holds(call, letters)
