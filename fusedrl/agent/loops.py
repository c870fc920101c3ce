"""Agent loops: turn one dataset row into one trajectory by calling the engine and tools.

A loop is a class with ``async def run(self, row, traj, ctx)``; register it with `register_agent_loop`.
A row picks its loop by its ``agent_name`` (dataset column, or ``extra_info.agent_name``); rows without
one use ``multi_turn.default_agent_name`` (``single_turn``, today's behaviour, unless configured). verl's
loop names ``single_turn_agent`` and ``tool_agent`` name the same two built-in loops.

``ctx`` (an `AgentContext`, given by the runner) offers ``generate(traj)`` (one assistant turn, token
ids in and out, through the shared engine) and ``call_tools(traj, calls, row)`` (parallel, time-limited
tool calls whose failures come back as error observations). Loops only append to ``traj``: sampled ids
(mask 1) and rendered observations (mask 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fusedrl.agent.env import Environment
from fusedrl.agent.parser import ToolCall, parse_hermes
from fusedrl.agent.render import ChatRenderer
from fusedrl.agent.trajectory import Trajectory


class AgentContext(Protocol):
    renderer: ChatRenderer | None  # None: a token-only run (plain single-turn generation); no text is read
    max_assistant_turns: int | None
    max_user_turns: int | None
    env_config: dict[str, Any]

    async def generate(
        self, traj: Trajectory, max_tokens: int | None = None
    ) -> tuple[list[int], list[float], str]: ...

    async def call_tools(self, traj: Trajectory, calls: list[ToolCall], row: dict[str, Any]) -> list[str]: ...

    async def call_env(self, traj: Trajectory, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]: ...


class AgentLoop:
    """Base class of agent loops."""

    async def run(self, row: dict[str, Any], traj: Trajectory, ctx: AgentContext) -> None:
        raise NotImplementedError


_LOOPS: dict[str, type[AgentLoop]] = {}


def register_agent_loop(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    """Class decorator: rows with ``agent_name == name`` run this loop."""

    def deco(cls: type[AgentLoop]) -> type[AgentLoop]:
        if name in _LOOPS and _LOOPS[name] is not cls:
            raise ValueError(f"agent loop {name!r} is already registered ({_LOOPS[name].__name__})")
        _LOOPS[name] = cls
        return cls

    return deco


def get_agent_loop(name: str) -> type[AgentLoop]:
    if name not in _LOOPS:
        raise KeyError(
            f"unknown agent_name {name!r}; registered loops: {sorted(_LOOPS)}. Register yours with "
            "fusedrl.agent.register_agent_loop (or register_environment) in a module listed in "
            "algorithm.custom_modules"
        )
    return _LOOPS[name]


def agent_loop_names() -> list[str]:
    return sorted(_LOOPS)


def _turns_left(traj: Trajectory, ctx: AgentContext) -> bool:
    """Whether another assistant turn may follow (so an observation is worth appending)."""
    if ctx.max_assistant_turns is not None and traj.stats["assistant_turns"] >= ctx.max_assistant_turns:
        return False
    return ctx.max_user_turns is None or traj.stats["user_turns"] < ctx.max_user_turns


async def assistant_turn(
    traj: Trajectory, ctx: AgentContext, max_tokens: int | None = None
) -> tuple[str, bool]:
    """One sampled turn appended to ``traj``. Returns its text and whether it ended with the stop token."""
    ids, log_probs, finish = await ctx.generate(traj, max_tokens)
    text = ctx.renderer.decode_turn(ids) if ctx.renderer is not None else ""
    traj.add_sampled(ids, log_probs, text)
    if finish == "length" and traj.remaining <= 0:
        traj.stats["hit_length_limit"] = 1.0
    return text, finish == "stop"


def append_observation(
    traj: Trajectory, ctx: AgentContext, messages: list[dict[str, Any]], after_stop: bool = True
) -> bool:
    """Render ``messages`` once and append them; False (nothing appended) when they do not fit.
    ``after_stop=False``: the last turn was cut (``max_tokens_per_turn``), so the observation first closes it
    with the stop text, which the model did not sample (mask 0)."""
    if ctx.renderer is None:
        raise RuntimeError("append_observation: this run has no chat renderer (token-only generation)")
    ids = ctx.renderer.observation_ids(messages, after_stop=after_stop)
    if not traj.fits(ids):
        traj.stats["hit_length_limit"] = 1.0
        return False
    traj.add_observation(ids, messages)
    return True


@register_agent_loop("single_turn")
class SingleTurnLoop(AgentLoop):
    """One response per prompt: the plain RL rollout. Every engine rollout's ``generate`` runs it
    (`fusedrl.workers.rollout.base.EngineRollout`); its request carries the row's own seed."""

    async def run(self, row: dict[str, Any], traj: Trajectory, ctx: AgentContext) -> None:
        await assistant_turn(traj, ctx)


@register_agent_loop("tool")
class ToolAgentLoop(AgentLoop):
    """Generate; run the Hermes-format tool calls of the turn; append their responses; repeat until the
    model answers without a call or a limit (turns, response length) is reached."""

    async def run(self, row: dict[str, Any], traj: Trajectory, ctx: AgentContext) -> None:
        while traj.remaining > 0:
            text, stopped = await assistant_turn(traj, ctx)
            calls = parse_hermes(text)
            if not stopped or not calls or not _turns_left(traj, ctx):
                return
            results = await ctx.call_tools(traj, calls, row)
            if not append_observation(traj, ctx, [{"role": "tool", "content": r} for r in results]):
                return


# verl's names for its two built-in loops (a row's agent_name, agent.default_agent_loop) run fusedrl's.
VERL_LOOP_NAMES = {"single_turn_agent": "single_turn", "tool_agent": "tool"}
for _verl_name, _name in VERL_LOOP_NAMES.items():
    register_agent_loop(_verl_name)(_LOOPS[_name])


class EnvironmentLoop(AgentLoop):
    """Drives an `Environment` (set as ``env_class`` by `register_environment`)."""

    env_class: type[Environment] = Environment

    async def run(self, row: dict[str, Any], traj: Trajectory, ctx: AgentContext) -> None:
        env = self.env_class(ctx.env_config)
        try:
            # reset / step run on the tool threads, off the loop that steps the engine: a slow environment
            # holds back its own trajectory only, and one past multi_turn.env_timeout_s ends it (`env_timeouts`).
            finished, _ = await ctx.call_env(traj, env.reset, row)
            while finished and traj.remaining > 0:
                text, stopped = await assistant_turn(traj, ctx)
                finished, result = await ctx.call_env(traj, env.step, text)
                if not finished:
                    return
                messages, reward, done = result
                traj.stats["reward"] += float(reward)
                # A turn cut by max_tokens_per_turn still goes to the environment, which decides.
                if done or not messages or not _turns_left(traj, ctx):
                    return
                if not append_observation(traj, ctx, list(messages), after_stop=stopped):
                    return
        finally:
            await ctx.call_env(traj, env.close)


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: rows with ``agent_name == name`` run this environment (see fusedrl.agent.env)."""

    def deco(env_cls: type[Environment]) -> type[Environment]:
        loop = type(f"{env_cls.__name__}Loop", (EnvironmentLoop,), {"env_class": env_cls})
        register_agent_loop(name)(loop)
        return env_cls

    return deco
