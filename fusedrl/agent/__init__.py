"""Agentic RL: multi-turn, tool-using rollouts inside the fused worker's own engine (docs/agentic.md)."""

from fusedrl.agent.env import Environment
from fusedrl.agent.loops import (
    AgentLoop,
    EnvironmentLoop,
    SingleTurnLoop,
    ToolAgentLoop,
    agent_loop_names,
    append_observation,
    assistant_turn,
    get_agent_loop,
    register_agent_loop,
    register_environment,
)
from fusedrl.agent.parser import ToolCall, parse_hermes
from fusedrl.agent.render import ChatRenderer, TemplateError, tokenization_mismatch
from fusedrl.agent.runner import AgentRunner, MultiTurnConfig, TurnSampling, truncate
from fusedrl.agent.tools import (
    FunctionTool,
    Tool,
    ToolConfigError,
    ToolResult,
    as_tool,
    function_schema,
)
from fusedrl.agent.toolset import ToolSet, load_tool_config
from fusedrl.agent.trajectory import STAT_NAMES, Trajectory

__all__ = [
    "STAT_NAMES",
    "AgentLoop",
    "AgentRunner",
    "ChatRenderer",
    "EnvironmentLoop",
    "Environment",
    "FunctionTool",
    "MultiTurnConfig",
    "SingleTurnLoop",
    "TemplateError",
    "Tool",
    "ToolAgentLoop",
    "ToolCall",
    "ToolConfigError",
    "ToolResult",
    "ToolSet",
    "Trajectory",
    "TurnSampling",
    "agent_loop_names",
    "append_observation",
    "assistant_turn",
    "as_tool",
    "function_schema",
    "get_agent_loop",
    "load_tool_config",
    "parse_hermes",
    "register_agent_loop",
    "register_environment",
    "tokenization_mismatch",
    "truncate",
]
