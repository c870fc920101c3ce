"""Rule reward for competition math (MATH, MATH-500, ...): the response's last ``\\boxed{...}``, checked
for mathematical equivalence with the reference by the ``math_verify`` library.

``math_verify`` is imported on first use, so the other rule rewards work without it.
"""

from __future__ import annotations

import threading
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_PARSE_TIMEOUT_S = 5  # math_verify's own alarm-based limits (main thread only)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Nested braces are matched; an unclosed box, or no box at all, gives None.
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    pos = start + len(command)
    if text.startswith(" ", pos):  # "\boxed 5": the argument runs to the next "$" or whitespace
        rest = text[pos + 1 :]
        arg = rest.split("$", 1)[0].split()
        return arg[0] if arg else None
    if not text.startswith("{", pos):
        return None
    depth = 0
    for end in range(pos, len(text)):
        char = text[end]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : end]
    return None


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError(
            "the math reward (data_source lighteval/MATH, HuggingFaceH4/MATH-500, math, ...) needs the "
            "math_verify library: pip install math-verify"
        ) from exc
    return math_verify


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0) -> float:
    """1.0 if the last ``\\boxed{...}`` of ``solution_str`` is equivalent to ``ground_truth``.

    "\\boxed{\\frac{1}{2}}" matches "0.5". A response with a box whose content is not equivalent scores
    ``format_score``; one without a (closed) box scores 0.0. ``ground_truth`` may be bare ("\\frac{1}{2}")
    or boxed.
    """
    mv = _math_verify()
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    # math_verify bounds its own work with SIGALRM, which only the main thread may use.
    limit = _PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    truth_text = str(ground_truth)
    gold = mv.parse(f"\\boxed{{{truth_text}}}", parsing_timeout=limit) or mv.parse(
        truth_text, parsing_timeout=limit
    )
    if not gold:
        raise ValueError(f"math ground_truth could not be parsed: {ground_truth!r}")
    predicted = mv.parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if not predicted:
        return float(format_score)
    return 1.0 if mv.verify(gold, predicted, timeout_seconds=limit) else float(format_score)
