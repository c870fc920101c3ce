"""A GSM8K-style answer checker written against verl's tool protocol (async create / execute / calc_reward /
release, ``(response, reward, metrics)`` from execute), as a verl recipe's tool module would be after
changing its imports to ``fusedrl.agent.verl_tools``. Used by the verl multi-turn recipe tests, which name
it in a verl-format tool YAML as ``verl_gsm8k_tool.Gsm8kAnswerTool`` (tests/ on the path).

The model submits ``{"answer": "..."}``; the tool keeps, per trajectory, the best score so far and answers
with what it parsed and whether it is right. A submission that does not improve on the best costs a small
penalty (the tool's step reward), as in verl's GSM8K tool.

``test_gsm8k_submit_twice`` is an agent loop for the trainer test: a random tiny model writes no tool call
of its own, so this loop submits the row's ground truth twice through the tool (scripted calls, with
sampled turns around them); listed in algorithm.custom_modules it registers on the workers.
"""

from __future__ import annotations

import re
from typing import Any

from fusedrl.agent import AgentLoop, ToolCall, append_observation, assistant_turn, register_agent_loop
from fusedrl.agent.verl_tools import BaseTool, ToolResponse

# Every call of every instance, for the tests: (event, instance id, detail).
EVENTS: list[tuple[str, str, Any]] = []

PENALTY = -0.05
TURN_TOKENS = 8  # sampled tokens per turn of the scripted loop: room for both submissions


def parse_number(text: str) -> str | None:
    """The last number in ``text`` (commas dropped), or None."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", str(text))
    return found[-1].replace(",", "") if found else None


class Gsm8kAnswerTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Any) -> None:
        super().__init__(config, tool_schema)
        self.correct_score = float(self.config.get("correct_score", 1.0))
        self._state: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any):
        if ground_truth is None:  # verl's current tool loop passes create_kwargs={...}
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        instance_id = instance_id or f"gsm8k-{len(self._state)}"
        self._state[instance_id] = {"answer": None, "ground_truth": ground_truth, "best": 0.0}
        EVENTS.append(("create", instance_id, ground_truth))
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        state = self._state[instance_id]
        state["answer"] = parse_number(parameters.get("answer", ""))
        score = await self.calc_reward(instance_id)
        step_reward = 0.0 if score > state["best"] else PENALTY
        state["best"] = max(state["best"], score)
        EVENTS.append(("execute", instance_id, state["answer"]))
        return ToolResponse(text=f"parsed answer={state['answer']} correct={score > 0}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state[instance_id]
        right = state["answer"] is not None and state["answer"] == parse_number(str(state["ground_truth"]))
        return self.correct_score if right else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        EVENTS.append(("release", instance_id, None))
        del self._state[instance_id]


@register_agent_loop("test_gsm8k_submit_twice")
class SubmitTwiceLoop(AgentLoop):
    """Turn; submit the right answer; turn; submit it again (no improvement: the penalty); turn."""

    async def run(self, row, traj, ctx):
        call = ToolCall(name="calc_gsm8k_reward", arguments={"answer": str(row["ground_truth"])})
        for _ in range(2):
            _, stopped = await assistant_turn(traj, ctx, max_tokens=TURN_TOKENS)
            results = await ctx.call_tools(traj, [call], row)
            messages = [{"role": "tool", "content": r} for r in results]
            if not append_observation(traj, ctx, messages, after_stop=stopped):
                return
        await assistant_turn(traj, ctx, max_tokens=TURN_TOKENS)
