"""Agent loop, environment and tools for the multi-turn trainer tests, loaded by the fused workers through
``algorithm.custom_modules``; the tool YAML names them as ``/abs/path/agent_plugins.py:name``."""

from __future__ import annotations

import os
import time

from fusedrl.agent import AgentLoop, Environment, parse_hermes, register_agent_loop, register_environment
from fusedrl.agent.loops import append_observation, assistant_turn

HANG_S = 20.0

BROKEN_CALLS = (
    '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
    '<tool_call>{"name": "sleepy", "arguments": {"x": 1}}</tool_call>'
    "<tool_call>{broken json</tool_call>"
    '<tool_call>{"name": "big", "arguments": {"n": 5000}}</tool_call>'
)


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: ignored.
    """
    raise ValueError(f"boom {x}")


def sleepy(x: int) -> str:
    """Hangs far past the timeout.

    Args:
        x: ignored.
    """
    time.sleep(HANG_S)
    return "late"


def big(n: int) -> str:
    """Answers far too much.

    Args:
        n: characters.
    """
    return "y" * n


@register_environment("plugin_count_env")
class CountEnv(Environment):
    """Two user observations, then done; reward 0.5 per step."""

    def reset(self, row):
        self.steps = 0

    def step(self, text):
        self.steps += 1
        return [{"role": "user", "content": f"go on {self.steps}"}], 0.5, self.steps >= 3


@register_environment("plugin_logged_env")
class LoggedEnv(CountEnv):
    """`CountEnv` appending ``open`` at reset and ``close`` at close to the file named by the environment
    variable ``PLUGIN_ENV_LOG`` (written in the workers' processes, read by the test)."""

    def reset(self, row):
        super().reset(row)
        self._log("open")

    def close(self):
        self._log("close")

    def _log(self, what):
        with open(os.environ["PLUGIN_ENV_LOG"], "a") as f:
            f.write(what + "\n")


@register_agent_loop("plugin_broken_tools")
class BrokenToolsLoop(AgentLoop):
    """Turn 1; the four broken calls (a random tiny model writes none itself); their responses; turn 2; a
    user message; turn 3."""

    async def run(self, row, traj, ctx):
        _, stopped = await assistant_turn(traj, ctx)
        results = await ctx.call_tools(traj, parse_hermes(BROKEN_CALLS), row)
        if not append_observation(
            traj, ctx, [{"role": "tool", "content": r} for r in results], after_stop=stopped
        ):
            return
        _, stopped = await assistant_turn(traj, ctx)
        if append_observation(traj, ctx, [{"role": "user", "content": "and now?"}], after_stop=stopped):
            await assistant_turn(traj, ctx)


@register_agent_loop("plugin_user_turns")
class UserTurnsLoop(AgentLoop):
    """Three turns with a user message between them, all on the engine's loop (no tool thread): its timing
    is the engine's alone, so runs that pause it are reproducible."""

    async def run(self, row, traj, ctx):
        _, stopped = await assistant_turn(traj, ctx)
        for k in range(2):
            if not append_observation(
                traj, ctx, [{"role": "user", "content": f"more {k}"}], after_stop=stopped
            ):
                return
            _, stopped = await assistant_turn(traj, ctx)
