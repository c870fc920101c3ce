"""One trajectory under construction: ids, the sampled-token mask, engine log-probs, counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Per-trajectory numbers returned to the driver as the columns of ``RolloutBatch.agent_stats`` [B, K].
STAT_NAMES = (
    "reward",  # environment / tool rewards summed over the trajectory (added to the score)
    "assistant_turns",
    "user_turns",  # observations appended (tool responses or environment messages)
    "tool_calls",
    "tool_errors",  # raised, malformed, unknown tool, too many calls
    "tool_timeouts",
    "tool_wall_s",
    "observation_tokens",
    "truncated_responses",  # tool responses cut to max_tool_response_length
    "hit_length_limit",  # the trajectory ran into data.max_response_length
    "env_timeouts",  # an environment's reset / step / close ran past env_timeout_s (the trajectory ended)
)


@dataclass
class Trajectory:
    """Built by an agent loop through `add_sampled` / `add_observation`; ``budget`` = max response tokens."""

    prompt_ids: list[int]
    budget: int
    index: int = 0  # the row's position in the step's batch (request ids, tool instance ids)
    seed: int | None = 0  # the row's sampling seed; each turn's seed derives from it and the turn index
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation after the prompt
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_NAMES, 0.0))
    created_tools: set[str] = field(default_factory=set)  # tools whose per-trajectory state exists
    turns_requested: int = 0
    # Per requested turn, where its sampled tokens start in ``response_ids`` (the context it continued): the
    # engine's recorded experts of turn ``t`` are those of request ``f"{index}.{t}"`` (routing replay).
    turn_starts: list[int] = field(default_factory=list)
    # Partial rollout (`fusedrl.agent.resumable`): per response token, the policy version that sampled it (0
    # on observation tokens, as on padding); ``turn_versions`` is what the runner hands the next
    # `add_sampled` (its turn may span a weight sync). Without it, sampled tokens take version 0.
    versions: list[int] = field(default_factory=list)
    turn_versions: list[int] | None = None

    @property
    def remaining(self) -> int:
        return self.budget - len(self.response_ids)

    def context_ids(self) -> list[int]:
        """What the engine is asked to continue: prompt + everything so far."""
        return self.prompt_ids + self.response_ids

    def add_sampled(self, ids: list[int], log_probs: list[float], text: str) -> None:
        versions = self.turn_versions if self.turn_versions is not None else [0] * len(ids)
        self.turn_versions = None
        # No log-probs: the turn did not ask for them (`SampleParams.log_probs`); 0.0 keeps the lists aligned
        # and the batch then carries no rollout_log_probs at all.
        log_probs = log_probs if log_probs else [0.0] * len(ids)
        ids, log_probs = ids[: self.remaining], log_probs[: self.remaining]
        self.versions += list(versions[: len(ids)]) + [0] * (len(ids) - len(versions))
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.log_probs += log_probs
        self.messages.append({"role": "assistant", "content": text})
        self.stats["assistant_turns"] += 1

    def fits(self, observation_ids: list[int]) -> bool:
        """Room for the observation and at least one more sampled token."""
        return len(observation_ids) < self.remaining

    def add_observation(self, ids: list[int], messages: list[dict[str, Any]]) -> None:
        self.response_ids += ids
        self.versions += [0] * len(ids)
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.messages += messages
        self.stats["user_turns"] += 1
        self.stats["observation_tokens"] += len(ids)

    def stat_row(self) -> list[float]:
        return [float(self.stats[name]) for name in STAT_NAMES]
