"""The CPU agentic example's pieces (examples/agentic/tool_use_cpu.py): the hidden-table tool loads from its
YAML and answers, the data holds the test rooms out of training, each tool demonstration's call parses to the
tool and its answer is the ground truth, and the SFT dataset (with the example's tokenizer and max_length) trains on the assistant turns only."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def data(example, tmp_path_factory):
    return example.write_data(str(tmp_path_factory.mktemp("agentic_data")), seed=0, n_sft=200)


def test_tool_loads_and_refuses_bad_rooms(example):
    from fusedrl.agent import ToolSet, load_tool_config, parse_hermes

    tools = ToolSet(load_tool_config(example.TOOLS_YAML))
    schema = tools.schemas()[0]["function"]
    assert schema["name"] == "lookup" and schema["parameters"]["properties"]["room"]["type"] == "integer"
    call = parse_hermes(example.call_text(482))[0]
    assert call.error is None and call.arguments == {"room": 482}
    code = tools["lookup"].execute("t", call.arguments)
    assert code == str(example.room_code(482)) and len(code) == 3
    for bad in (99, 1000, "482", True):
        with pytest.raises(ValueError, match="room must be an integer"):
            tools["lookup"].execute("t", {"room": bad})


def test_test_rooms_are_held_out(data):
    def rooms(path, column):
        df = pd.read_parquet(path)
        texts = [m[0]["content"] for m in df[column]]
        return {int("".join(ch for ch in t if ch.isdigit())) for t in texts}

    test = rooms(data["test"], "prompt")
    assert len(test) == 64
    assert not test & rooms(data["train"], "prompt")
    assert not test & rooms(data["sft"], "messages")
    assert not test & rooms(data["sft_direct"], "messages")


def test_demonstrations_call_the_tool_and_copy_its_answer(example, data):
    from fusedrl.agent import parse_hermes

    df = pd.read_parquet(data["sft"])
    used = 0
    for messages in df["messages"]:
        room = int("".join(ch for ch in messages[0]["content"] if ch.isdigit()))
        if len(messages) == 2:  # the guessing annotator: a made-up code, never the true one
            assert messages[1]["content"] != f"{example.room_code(room)}."
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
    room = int("".join(ch for ch in df["messages"][i][0]["content"] if ch.isdigit()))
    item = SFTDataset(data["sft"], tok, max_length=96)[i]
    trained = tok.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if m])
    code = example.room_code(room)
    assert trained == f"{example.call_text(room)}<|im_end|>{code}.<|im_end|>"
