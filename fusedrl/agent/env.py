"""Gym-style environments for multi-turn tasks without tool-call syntax (games, user simulators).

An environment is created per trajectory::

    class Guess(Environment):
        def reset(self, row):            # the dataset row: prompt_ids, extra_info, ground_truth, ...
            self.target = int(row["ground_truth"])
        def step(self, text):            # the model's last turn, decoded (stop token removed)
            done = text.strip() == str(self.target)
            return [{"role": "user", "content": "correct" if done else "try again"}], float(done), done

The first observation is the dataset prompt. Every ``step`` returns the observation messages rendered
after the model's turn, a reward (summed over the trajectory into its score; the reward function may add
to it) and ``done``. Register an environment with `register_environment`; rows select it by
``agent_name``.
"""

from __future__ import annotations

from typing import Any


class Environment:
    """Base class; ``config`` is ``multi_turn.env_config`` (a dict, possibly empty)."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode for this dataset row."""

    def step(self, text: str) -> tuple[list[dict[str, str]], float, bool]:
        """``(observation messages, reward, done)`` after the model's turn ``text``."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the trajectory ends, whatever happened."""
