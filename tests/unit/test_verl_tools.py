"""verl's multi-turn tool recipe on fusedrl's agent loop: verl-format tool YAML with verl-style tool classes
(adapter), verl's loop names per row, the recipe's command line, and clear errors for bad inputs."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from fusedrl.agent import (
    AgentRunner,
    ChatRenderer,
    MultiTurnConfig,
    ToolAgentLoop,
    ToolConfigError,
    ToolResult,
    ToolSet,
    TurnSampling,
    get_agent_loop,
    load_tool_config,
)
from fusedrl.agent.verl_tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse, VerlToolAdapter

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "check an answer",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string"}},
            "required": ["answer"],
        },
    },
}


def _yaml(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def _gsm8k_yaml(tmp_path: Path, config: str = "{type: native}") -> Path:
    from verl_multiturn_recipe import TOOL_YAML

    return _yaml(tmp_path, TOOL_YAML.replace("config:\n      type: native", f"config: {config}"))


def test_verl_tool_yaml_loads_and_the_adapter_runs_the_lifecycle(tmp_path):
    import verl_gsm8k_tool as mod

    (tool,) = load_tool_config(_gsm8k_yaml(tmp_path, "{type: native, correct_score: 2.0}"))
    assert isinstance(tool, VerlToolAdapter) and isinstance(tool.tool, mod.Gsm8kAnswerTool)
    assert tool.name == "calc_gsm8k_reward" and tool.tool.name == "calc_gsm8k_reward"
    assert tool.schema["function"]["parameters"]["required"] == ["answer"]
    assert tool.tool.correct_score == 2.0 and tool.config["type"] == "native"  # config reaches the class
    assert tool.tool.tool_schema.function.name == "calc_gsm8k_reward"  # verl's attribute access
    assert tool.tool.tool_schema.model_dump()["function"]["description"].startswith("A tool for calculating")

    mod.EVENTS.clear()
    tool.create("0:calc_gsm8k_reward", ground_truth="72")
    first = tool.execute("0:calc_gsm8k_reward", {"answer": "#### 72"})
    again = tool.execute("0:calc_gsm8k_reward", {"answer": "72"})
    wrong = tool.execute("0:calc_gsm8k_reward", {"answer": "71"})
    assert first == ToolResult("parsed answer=72 correct=True", 0.0)
    assert again == ToolResult("parsed answer=72 correct=True", mod.PENALTY)  # no improvement: penalty
    assert wrong == ToolResult("parsed answer=71 correct=False", mod.PENALTY)
    assert tool.calc_reward("0:calc_gsm8k_reward") == 0.0  # the last answer is the wrong one
    tool.release("0:calc_gsm8k_reward")
    assert [e[0] for e in mod.EVENTS] == ["create", "execute", "execute", "execute", "release"]
    assert {e[1] for e in mod.EVENTS} == {"0:calc_gsm8k_reward"} and mod.EVENTS[0][2] == "72"
    assert tool.tool._state == {}  # released


class _KeywordOnlyCreate(BaseTool):
    """verl's current calling convention only: create(create_kwargs=...); its own instance ids."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.seen: dict[str, dict] = {}

    async def create(self, instance_id=None, *, create_kwargs=None):
        new_id = f"own-{len(self.seen)}"
        self.seen[new_id] = dict(create_kwargs or {})
        return new_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return {"id": instance_id, "seen": self.seen[instance_id], "args": parameters, **kwargs}, None, {}

    async def release(self, instance_id, **kwargs):
        del self.seen[instance_id]


class _PlainProtocol:
    """No base class at all: only the protocol (a str response, a 2-tuple, the schema from a method)."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id, **kwargs):
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        return f"echo {parameters['answer']}", 0.5

    async def release(self, instance_id, **kwargs):
        return None


class _Picture(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="look", image=["<image>"]), 0.0, {}


def test_adapter_calling_conventions_and_responses():
    schema = OpenAIFunctionToolSchema(SCHEMA)
    kw = VerlToolAdapter(_KeywordOnlyCreate({}, schema))
    kw.create("3:calc_gsm8k_reward", ground_truth="5")
    out = kw.execute("3:calc_gsm8k_reward", {"answer": "5"}, hint="x")
    # create got create_kwargs= (not spread: the signature does not take them); execute got the tool's own
    # id; a dict response is JSON; a None reward is 0
    assert out.reward == 0.0
    assert out.text == '{"id": "own-0", "seen": {"ground_truth": "5"}, "args": {"answer": "5"}, "hint": "x"}'
    kw.release("3:calc_gsm8k_reward")
    assert kw.tool.seen == {}

    plain = VerlToolAdapter(_PlainProtocol({}, SCHEMA))
    plain.create("1:x")
    assert (
        plain.execute("1:x", {"answer": "9"}) == ToolResult("echo 9", 0.5)
        and plain.name == SCHEMA["function"]["name"]
    )

    pic = VerlToolAdapter(_Picture({}, SCHEMA))
    with pytest.raises(ValueError, match="text only"):
        pic.execute("1:x", {"answer": "1"})


def test_bad_tool_configs_are_clear_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ToolConfigError, match=r"nope\.yaml: tool config not found .*tool_config_path"):
        load_tool_config(missing)

    bad = _yaml(tmp_path, "tools:\n  - class_name: no_such_pkg.tools.Thing\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: cannot import 'no_such_pkg.tools.Thing'"):
        load_tool_config(bad)

    # verl's own tool class, as in verl's gsm8k_tool_config.yaml: verl is not installed; the fix is named
    verl_cls = _yaml(
        tmp_path, 'tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    config: {type: native}\n'
    )
    with pytest.raises(ToolConfigError, match=r"verl is not installed.*fusedrl\.agent\.verl_tools"):
        load_tool_config(verl_cls)

    no_name = _yaml(
        tmp_path,
        """\
        tools:
          - class_name: verl_gsm8k_tool.Gsm8kAnswerTool
            tool_schema: {type: function, function: {description: checks, parameters: {type: object}}}
        """,
    )
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.tool_schema: tool_schema\.function has no name"):
        load_tool_config(no_name)

    no_schema = _yaml(tmp_path, "tools:\n  - class_name: verl_gsm8k_tool.Gsm8kAnswerTool\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: tool class Gsm8kAnswerTool has no schema"):
        load_tool_config(no_schema)

    with pytest.raises(ToolConfigError, match=r"config\.type='mcp': only native tools"):
        load_tool_config(_gsm8k_yaml(tmp_path, "{type: mcp}"))

    not_a_tool = _yaml(tmp_path, "tools:\n  - class_name: fusedrl.agent.tools.ToolResult\n")
    with pytest.raises(
        ToolConfigError, match="neither a fusedrl.agent.Tool subclass, a verl-style tool class"
    ):
        load_tool_config(not_a_tool)


def test_verl_loop_names_and_config_checks():
    assert get_agent_loop("tool_agent") is ToolAgentLoop is get_agent_loop("tool")
    assert get_agent_loop("single_turn_agent") is get_agent_loop("single_turn")
    problems = MultiTurnConfig.from_dict(
        {"format": "gpt-oss", "default_agent_name": "react_agent"}
    ).problems()
    assert len(problems) == 2
    assert (
        problems[0].startswith("`actor_rollout_ref.rollout.multi_turn.format`='gpt-oss'")
        and "hermes" in problems[0]
    )
    assert problems[1].startswith("`actor_rollout_ref.rollout.multi_turn.default_agent_name`='react_agent'")
    assert "tool_agent" in problems[1] and "single_turn_agent" in problems[1]
    assert MultiTurnConfig.from_dict({"default_agent_name": "tool_agent"}).problems() == []


def test_unknown_agent_name_names_the_row_and_the_loops(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    from verl_multiturn_recipe import write_rows

    from fusedrl.agent import agent_loop_names
    from fusedrl.data.dataset import DataError, RLDataset

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    good = write_rows(tmp_path / "good.parquet", 4, ("tool_agent", "single_turn_agent"))
    ds = RLDataset(good, tok, 256, agent_names=agent_loop_names())
    assert [ds[i]["extra_info"]["agent_name"] for i in range(4)] == ["tool_agent", "single_turn_agent"] * 2
    bad = write_rows(tmp_path / "bad.parquet", 3, ("tool_agent", "tool_agnet", "tool_agent"))
    with pytest.raises(DataError) as info:
        RLDataset(bad, tok, 256, agent_names=agent_loop_names())
    msg = str(info.value)
    assert "1 bad row(s)" in msg and "row 1: agent_name 'tool_agnet' is not an agent loop" in msg
    assert "single_turn_agent" in msg and "tool_agent" in msg
    RLDataset(bad, tok, 256)  # single-turn runs do not look at agent_name


class _ScriptedEngine:
    """The engine interface of fusedrl.agent.runner: each request answers with the next scripted text."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.queue = tok, list(texts), []

    def submit(self, request_id, prompt_ids, params):
        self.queue.append(request_id)

    def num_unfinished(self):
        return len(self.queue)

    def step(self):
        out = []
        for rid in self.queue:
            turn = int(rid.split(".")[1])
            ids = self.tok.encode(self.texts[turn], add_special_tokens=False) + [self.tok.eos_token_id]
            out.append((rid, ids, [0.0] * len(ids), "stop"))
        self.queue = []
        return out


def test_tool_agent_rows_run_the_verl_tool_in_the_runner(tiny_model_dir, tmp_path):
    """Rows named ``tool_agent`` run fusedrl's tool loop: the model's Hermes call reaches the verl tool with the
    row's create_kwargs, the tool's step rewards are summed into the trajectory, each instance is released."""
    import verl_gsm8k_tool as mod
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = ToolSet(load_tool_config(_gsm8k_yaml(tmp_path)))
    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "%s"}}</tool_call>'
    engine = _ScriptedEngine(tok, [call % "12", call % "12", "#### 12"])
    cfg = MultiTurnConfig(default_agent_name="single_turn", max_assistant_turns=5)
    runner = AgentRunner(engine, ChatRenderer(tok, tools.schemas()), tools, cfg)
    prompt = tok.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    rows = [
        dict(
            prompt_ids=prompt,
            agent_name="tool_agent",
            extra_info={"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}},
            seed=k,
        )
        for k, truth in enumerate(["12", "13"])
    ]
    rows.append(dict(prompt_ids=prompt, agent_name="single_turn_agent", seed=2))
    mod.EVENTS.clear()
    trajs = runner.run(rows, TurnSampling(stop_token_id=tok.eos_token_id), max_response_length=400)
    right, wrong, single = trajs
    assert [m["content"] for m in right.messages if m["role"] == "tool"] == [
        "parsed answer=12 correct=True"
    ] * 2
    assert right.stats["reward"] == mod.PENALTY  # first submission improves (0), the second does not
    assert wrong.stats["reward"] == 2 * mod.PENALTY  # 12 is wrong for 13: never an improvement
    assert (right.stats["tool_calls"], right.stats["assistant_turns"]) == (2, 3)
    assert (single.stats["assistant_turns"], single.stats["tool_calls"]) == (1, 0)
    created = sorted((e[1], e[2]) for e in mod.EVENTS if e[0] == "create")
    assert created == [("0:calc_gsm8k_reward", "12"), ("1:calc_gsm8k_reward", "13")]  # once per trajectory
    assert sorted(e[1] for e in mod.EVENTS if e[0] == "release") == [
        "0:calc_gsm8k_reward",
        "1:calc_gsm8k_reward",
    ]
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool, VerlToolAdapter) and tool.tool._state == {}


def test_verl_multiturn_recipe_command_line_loads(tiny_model_dir, tmp_path):
    """verl's GSM8K multi-turn tool recipe loads with no rejected key; its multi-turn keys land in fusedrl's
    config, verl's loop name picks the default loop, and only the documented keys are named as no-effect."""
    from verl_multiturn_recipe import recipe

    from fusedrl.config import load_config

    lines: list[str] = []
    line = recipe(tmp_path, tiny_model_dir)
    cfg = load_config(["--config-name", "ppo_trainer", *line], report=lines.append)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable is True and mt.max_assistant_turns == 5 and mt.max_user_turns == 5
    assert (mt.max_parallel_calls, mt.max_tool_response_length, mt.tool_response_truncate_side) == (
        1,
        256,
        "middle",
    )
    assert mt.format == "hermes" and mt.tool_config_path == str(tmp_path / "gsm8k_tool_config.yaml")
    assert mt.default_agent_name == "tool_agent"  # from actor_rollout_ref.rollout.agent.default_agent_loop
    assert len(lines) == 1
    ignored = lines[0]
    for key in ("tokenization_sanity_check_mode", "use_inference_chat_template", "num_repeat_rollouts"):
        assert f"multi_turn.{key}" in ignored
    for key in (
        "enable",
        "max_assistant_turns",
        "tool_config_path",
        "format",
        "tool_response_truncate_side",
        "default_agent",
    ):
        assert f"multi_turn.{key}" not in ignored and f"agent.{key}" not in ignored
    tools = ToolSet.from_config(dict(mt))
    assert isinstance(tools["calc_gsm8k_reward"], VerlToolAdapter)


@pytest.mark.parametrize(
    "override, words",
    [
        ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=/x/interaction.yaml", "Environment"),
        ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True", "sampled"),
        ("actor_rollout_ref.rollout.multi_turn.format=gpt-oss", "hermes"),
        ("actor_rollout_ref.rollout.multi_turn.function_tool_path=/x/tools.py", "tool_config_path"),
        ("actor_rollout_ref.rollout.agent.default_agent_loop=react_agent", "tool_agent"),
    ],
)
def test_verl_multiturn_values_fusedrl_cannot_run_are_refused(tiny_model_dir, tmp_path, override, words):
    from verl_multiturn_recipe import recipe

    from fusedrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config([*recipe(tmp_path, tiny_model_dir), override], report=lambda _: None)
    key = override.split("=")[0].replace("agent.default_agent_loop", "multi_turn.default_agent_name")
    (problem,) = [p for p in info.value.problems if key in p]
    assert words in problem, problem


def test_a_missing_tool_yaml_is_a_config_problem(tiny_model_dir, tmp_path):
    from verl_multiturn_recipe import recipe

    from fusedrl.config import ConfigError, load_config

    line = [ov for ov in recipe(tmp_path, tiny_model_dir) if "tool_config_path" not in ov]
    with pytest.raises(ConfigError) as info:
        load_config(
            [*line, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'gone.yaml'}"]
        )
    assert any(
        "tool_config_path" in p and "gone.yaml" in p and "does not exist" in p for p in info.value.problems
    )


def test_adapter_keeps_one_event_loop_per_tool():
    """Coroutines of one tool run on one loop (loop-bound state such as a client survives between calls)."""

    class LoopBound(BaseTool):
        async def create(self, instance_id=None, **kwargs):
            self.loop = asyncio.get_running_loop()
            return instance_id, ToolResponse()

        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text=str(asyncio.get_running_loop() is self.loop)), 0.0, {}

    tool = VerlToolAdapter(LoopBound({}, SCHEMA))
    tool.create("0:x")
    assert [tool.execute("0:x", {}).text for _ in range(3)] == ["True"] * 3
