"""The reward of the Geometry3K GPU recipe (``custom_reward_function.path`` of run_qwen2_5_vl_3b_geo3k.sh).

Accuracy: the response's last ``\\boxed{...}`` is mathematically equivalent to the reference (fusedrl's
built-in math rule, `fusedrl.rewards.math_boxed`, which uses ``math_verify``). Format: the response opens with
a ``<think> ... </think>`` block and has a box after it. The score is ``0.9 * accuracy + 0.1 * format``, so a
well-formed wrong answer earns a little and a right answer without the format most of the reward.
"""

from __future__ import annotations

import re
from typing import Any

from fusedrl.rewards import math_boxed

_FORMAT = re.compile(r"^\s*<think>.*?</think>.*\\boxed\{.*\}", re.DOTALL)
ACCURACY_WEIGHT = 0.9


def format_ok(solution_str: str) -> bool:
    """True when the response is ``<think> reasoning </think> ... \\boxed{answer}``."""
    return _FORMAT.match(solution_str) is not None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """``0.9 * [boxed answer equals ground_truth] + 0.1 * [think-then-box format]``."""
    accuracy = math_boxed.compute_score(solution_str, ground_truth)
    return ACCURACY_WEIGHT * accuracy + (1.0 - ACCURACY_WEIGHT) * float(format_ok(solution_str))
