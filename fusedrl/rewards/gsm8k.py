"""Rule reward for GSM8K: the number after the response's last ``####`` against the reference answer."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# What may follow "####": optional spaces and a dollar sign, then a number with optional thousands commas
# and an optional decimal part ("1,234", "-7", "3.50", "$12").
_ANSWER = re.compile(r"\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")


def extract_answer(solution_str: str) -> str | None:
    """The number right after the last ``####`` of ``solution_str`` with commas removed, or None."""
    head, marker, tail = solution_str.rpartition("####")
    if not marker:
        return None
    match = _ANSWER.match(tail)
    if match is None:
        return None
    return match.group(1).replace(",", "")


def _to_decimal(text: str) -> Decimal | None:
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def compute_score(
    solution_str: str, ground_truth: str | int | float, format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the answer after the last ``####`` equals ``ground_truth`` numerically, else less.

    "#### 1,234" matches "1234" and "1234.0". A response with a ``####`` answer that is wrong scores
    ``format_score``; one without a ``####`` followed by a number scores 0.0. A ground truth in GSM8K's raw
    form ("...reasoning... #### 72") is reduced to the number after its ``####`` first.
    """
    truth_text = str(ground_truth)
    if "####" in truth_text:
        truth_text = truth_text.rpartition("####")[2]
    truth = _to_decimal(truth_text.strip().lstrip("$").replace(",", ""))
    if truth is None:
        raise ValueError(f"gsm8k ground_truth must be a number, got {ground_truth!r}")
    answer_text = extract_answer(solution_str)
    if answer_text is None:
        return 0.0
    answer = _to_decimal(answer_text)
    if answer is None:
        return float(format_score)
    return float(score) if answer == truth else float(format_score)
