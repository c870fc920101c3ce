"""fusedrl.agent without an engine: tool schemas, the YAML loader, the Hermes parser, observation
rendering (token deltas of the real tiny tokenizer's ChatML template), truncation, config checks."""

from __future__ import annotations

import textwrap
from typing import Literal

import pytest

from fusedrl.agent import (
    ChatRenderer,
    FunctionTool,
    MultiTurnConfig,
    TemplateError,
    Tool,
    ToolConfigError,
    ToolResult,
    ToolSet,
    function_schema,
    load_tool_config,
    parse_hermes,
    tokenization_mismatch,
    truncate,
)


def lookup(key: str, table: Literal["a", "b"] = "a", scale: float = 1.0) -> str:
    """Look a key up in a table.

    Args:
        key: the row to read.
        table (str): which table; the second
            line of its description.
        scale: a factor.

    Returns:
        the value.
    """
    return f"{table}:{key}:{scale}"


class Counter(Tool):
    """A stateful tool: counts calls per trajectory, starting from create_kwargs['start']."""

    schema = {
        "type": "function",
        "function": {
            "name": "counter",
            "description": "count",
            "parameters": {"type": "object", "properties": {}},
        },
    }

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.state: dict[str, int] = {}
        self.released: list[str] = []

    def create(self, instance_id, start=0):
        self.state[instance_id] = int(start)

    def execute(self, instance_id, arguments, **kwargs):
        self.state[instance_id] += int(self.config.get("step", 1))
        return ToolResult(str(self.state[instance_id]), reward=0.5)

    def release(self, instance_id):
        self.released.append(instance_id)
        del self.state[instance_id]


def test_function_schema_from_hints_and_docstring():
    schema = function_schema(lookup)
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "lookup"
    assert fn["description"] == "Look a key up in a table."
    props = fn["parameters"]["properties"]
    assert props["key"] == {"type": "string", "description": "the row to read."}
    assert props["table"] == {
        "type": "string",
        "enum": ["a", "b"],
        "description": "which table; the second line of its description.",
    }
    assert props["scale"]["type"] == "number"
    assert fn["parameters"]["required"] == ["key"]
    assert FunctionTool(lookup).execute("x", {"key": "k", "table": "b"}) == "b:k:1.0"


def test_function_tool_errors_are_clear():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x):
        """Doc."""

    with pytest.raises(ToolConfigError, match="docstring"):
        function_schema(no_doc)
    with pytest.raises(ToolConfigError, match="type hint"):
        function_schema(no_hint)
    with pytest.raises(TypeError, match="unknown argument"):
        FunctionTool(lookup).execute("x", {"key": "k", "bogus": 1})


def test_yaml_loader_verl_format(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            tools:
              - class_name: {__name__}.Counter
                config: {{step: 2}}
                tool_schema:
                  type: function
                  function: {{name: counter2, description: c, parameters: {{type: object, properties: {{}}}}}}
              - class_name: {__name__}.lookup
            """
        )
    )
    tools = load_tool_config(path)
    assert [t.name for t in tools] == ["counter2", "lookup"]
    assert tools[0].config == {"step": 2}
    toolset = ToolSet.from_config({"tool_config_path": str(path)}, extra=[Counter()])
    assert sorted(toolset.tools) == ["counter", "counter2", "lookup"]
    with pytest.raises(ToolConfigError, match="unique"):
        ToolSet([Counter(), Counter()])
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: nope.Missing\n")
    with pytest.raises(ToolConfigError, match=r"bad.yaml: tools\[0\]: cannot import"):
        load_tool_config(bad)


def test_hermes_parser():
    text = (
        'I will call. <tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
        '<tool_call>\n{"name": "counter", "arguments": "{}"}\n</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "a", "arguments": 3}</tool_call>'
        '<tool_call>{"name"'
    )
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("lookup", {"key": "x"}, True),
        ("counter", {}, True),
    ]
    errors = [c.error for c in calls[2:]]
    assert len(errors) == 5 and all(errors)
    assert "not valid JSON" in errors[0] and "JSON object" in errors[1] and "name" in errors[2]
    assert "arguments" in errors[3] and "unterminated" in errors[4]
    assert parse_hermes("no calls here") == []


def test_observation_delta_and_check(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = ChatRenderer(tok)
    assert r.stop_text == "<|im_end|>" and r.separator == "\n"
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt_ids = tok.encode(r.render(prompt, add_generation_prompt=True), add_special_tokens=False)
    turn1 = tok.encode("call<|im_end|>", add_special_tokens=False)
    obs = [{"role": "tool", "content": "5"}]
    obs_ids = r.observation_ids(obs)
    # The delta starts with the separator the model did not sample and ends with the generation prompt.
    assert tok.decode(obs_ids) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    turn2 = tok.encode("The answer is 5<|im_end|>", add_special_tokens=False)
    ids = prompt_ids + turn1 + obs_ids + turn2
    conversation = [
        *prompt,
        {"role": "assistant", "content": "call"},
        *obs,
        {"role": "assistant", "content": "The answer is 5"},
    ]
    assert tokenization_mismatch(r, conversation, ids, ends_with_generation_prompt=False) is None
    # One wrong token is reported at its position.
    bad = list(ids)
    bad[len(prompt_ids) + len(turn1) + 2] = tok.encode("zz", add_special_tokens=False)[0]
    report = tokenization_mismatch(r, conversation, bad, ends_with_generation_prompt=False)
    assert report is not None and report.startswith(f"token {len(prompt_ids) + len(turn1) + 2}:")


def test_non_prefix_preserving_template_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Like templates that drop earlier reasoning: earlier assistant turns render differently once more follow.
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\\n[hidden]<|im_end|>\\n' }}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    r = ChatRenderer(tok)
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        r.observation_ids([{"role": "tool", "content": "5"}])


def test_truncate_sides():
    text = "a" * 50 + "b" * 50
    assert truncate(text, 200, "middle") == (text, False)
    for side in ("left", "right", "middle"):
        cut, was = truncate(text, 40, side)
        assert was and len(cut) == 40 and "(truncated)" in cut
    # verl (since its 2026-05 tool-loop fix): the side named is the side cut
    assert truncate(text, 40, "left")[0] == "...(truncated)..." + "b" * 23
    assert truncate(text, 40, "right")[0] == "a" * 23 + "...(truncated)..."
    cut = truncate(text, 40, "middle")[0]
    assert cut.startswith("a") and cut.endswith("b")


def test_multi_turn_config_problems():
    cfg = MultiTurnConfig.from_dict(
        {
            "tool_response_truncate_side": "up",
            "tokenization_check": "yes",
            "max_parallel_calls": 0,
            "max_user_turns": 0,
        }
    )
    problems = cfg.problems()
    assert len(problems) == 4
    assert any("tool_response_truncate_side" in p for p in problems)
    assert MultiTurnConfig.from_dict({"max_assistant_turns": "3"}).max_assistant_turns == 3
    assert MultiTurnConfig.from_dict({"tokenization_check": False}).tokenization_check == "off"
