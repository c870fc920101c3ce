"""Reward functions, chosen per sample by the row's ``data_source``.

A scoring function has the signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` (a dict must
hold the reward under ``"score"``; its other numeric entries are reported as metrics). `NaiveRewardManager`
calls one on every decoded response; `default_compute_score` is the built-in dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fusedrl.rewards import arithmetic

# data_source -> fn(solution_str, ground_truth) -> float
_RULE_SCORERS: dict[str, Callable[[str, Any], float]] = {
    "arithmetic": arithmetic.compute_score,
}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float | dict:
    """Score one response with the built-in rule for its ``data_source``."""
    scorer = _RULE_SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r} (built-in: {sorted(_RULE_SCORERS)}); "
            f"write a compute_score(data_source, solution_str, ground_truth, extra_info) function and set "
            f"custom_reward_function.path (and custom_reward_function.name) to it"
        )
    return scorer(solution_str, ground_truth)


def __getattr__(name: str):  # lazy: the manager imports torch, the rule scorers do not
    if name == "NaiveRewardManager":
        from fusedrl.rewards.manager import NaiveRewardManager

        return NaiveRewardManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NaiveRewardManager", "default_compute_score"]
