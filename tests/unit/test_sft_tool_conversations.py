"""SFT on multi-turn tool conversations: structured tool_calls rendered by the template, tool responses and
the tool list as context, the loss on assistant tokens only."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusedrl.data.dataset import DataError
from fusedrl.data.sft_dataset import SFTDataset

# ChatML plus Qwen-style tools: the tool list in a system turn, calls as <tool_call> JSON, tool turns.
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' }}{% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' + c['function']['arguments'] + '}</tool_call>' }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SCHEMA = {"type": "function", "function": {"name": "multiply", "description": "a*b", "parameters": {}}}


def _conversation(a: int, b: int) -> list[dict]:
    args = json.dumps({"a": a, "b": b})
    return [
        {"role": "user", "content": f"What is {a} times {b}?", "tool_calls": None},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": args}}],
        },
        {"role": "tool", "content": str(a * b), "tool_calls": None},
        {"role": "assistant", "content": f"The answer is {a * b}.", "tool_calls": None},
    ]


def test_loss_on_assistant_tokens_only(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOL_TEMPLATE
    path = str(tmp_path / "tools.parquet")
    rows = [{"messages": _conversation(123, 456), "tools": json.dumps([SCHEMA])}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = SFTDataset(path, tok, max_length=512)
    item = ds[0]
    ids, mask = item["input_ids"], item["loss_mask"]
    # Everything rendered, tool list included.
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nTools: multiply <|im_end|>\n")
    assert "<|im_start|>tool\n56088<|im_end|>" in text
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == (
        '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call><|im_end|>'
        "The answer is 56088.<|im_end|>"
    )


def test_bad_tool_calls_are_reported(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOL_TEMPLATE
    conv = _conversation(1, 2)
    conv[1]["tool_calls"] = [{"type": "function", "function": {"name": "", "arguments": "{}"}}]
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": conv}]), path)
    with pytest.raises(DataError, match=r"row 0: message 1: tool_calls\[0\] needs function.name"):
        SFTDataset(path, tok, max_length=512)
