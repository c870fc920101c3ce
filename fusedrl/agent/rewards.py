"""Driver-side use of the agent's per-trajectory numbers: rewards on the last sampled token, metrics."""

from __future__ import annotations

import torch

from fusedrl.agent.trajectory import STAT_NAMES
from fusedrl.batch import on_last_sampled_token


def add_agent_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, agent_stats: torch.Tensor
) -> torch.Tensor:
    """``scores`` [B, Tr] plus each trajectory's environment / tool reward on its last sampled token."""
    reward = agent_stats[:, STAT_NAMES.index("reward")]  # [B]
    return scores + on_last_sampled_token(reward, response_mask).to(scores.dtype)


def agent_metrics(agent_stats: torch.Tensor) -> dict[str, float]:
    """Per-step means (and a few totals) of the per-trajectory numbers, as ``agent/*`` metrics."""
    stats = agent_stats.float()  # [B, K]
    out: dict[str, float] = {}
    for k, name in enumerate(STAT_NAMES):
        out[f"agent/{name}/mean"] = float(stats[:, k].mean())
    for name in ("tool_calls", "tool_errors", "tool_timeouts", "env_timeouts", "observation_tokens"):
        out[f"agent/{name}/total"] = float(stats[:, STAT_NAMES.index(name)].sum())
    out["agent/assistant_turns/max"] = float(stats[:, STAT_NAMES.index("assistant_turns")].max())
    return out
