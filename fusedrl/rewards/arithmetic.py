"""Rule reward for the synthetic arithmetic task: is the last integer in the response the answer?"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def compute_score(solution_str: str, ground_truth: str | int, format_score: float = 0.0) -> float:
    """1.0 if the last integer in ``solution_str`` (optional leading minus) equals ``ground_truth``.

    A response without any integer scores 0.0; one whose last integer is wrong scores ``format_score``
    (0.0 by default). ``ground_truth`` must hold an integer ("68", "-5", 68).
    """
    try:
        expected = int(str(ground_truth).strip())
    except ValueError as exc:
        raise ValueError(f"arithmetic ground_truth must be an integer, got {ground_truth!r}") from exc
    matches = _INTEGER.findall(solution_str)
    if not matches:
        return 0.0
    try:
        answer = int(matches[-1])
    except ValueError:  # e.g. more digits than Python's int-from-string limit: not the answer anyway
        return float(format_score)
    return 1.0 if answer == expected else float(format_score)
