"""Rule reward for the Countdown numbers game: combine the given numbers, each exactly once, with
``+ - * /`` and parentheses to reach the target.

The response's equation is the content of its last ``<answer>...</answer>``. It is evaluated by walking
its syntax tree, accepting only integer literals, the four binary operators and grouping, with exact
rational arithmetic; nothing in it is ever executed as Python.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# pandas/numpy rows stringify lists as "array([1, 2, 3])" (optionally with ", dtype=int64").
_NUMPY_ARRAY = re.compile(r"array\(\s*(\[[^\]]*\])\s*(?:,\s*dtype=[\w.]+\s*)?\)")
_MAX_EQUATION_CHARS = 256  # far above any real countdown answer; bounds parsing work on garbage

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,  # Fraction / Fraction: exact; raises ZeroDivisionError on 0
}


class InvalidEquation(ValueError):
    """The equation uses something other than integers, + - * / and parentheses, or divides by 0."""


def parse_ground_truth(ground_truth: Any) -> tuple[int, list[int]]:
    """``(target, numbers)`` from a dict or its JSON / Python-literal string form."""
    value = ground_truth
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = ast.literal_eval(_NUMPY_ARRAY.sub(r"\1", text))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                value = None
    if not isinstance(value, Mapping) or "target" not in value or "numbers" not in value:
        raise ValueError(
            f'countdown ground_truth must be {{"target": int, "numbers": [int, ...]}} (a dict or its JSON '
            f"string), got {ground_truth!r}"
        )
    try:
        target = int(value["target"])
        numbers = [int(n) for n in value["numbers"]]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"countdown ground_truth has non-integer target or numbers: {ground_truth!r}"
        ) from exc
    return target, numbers


def extract_equation(solution_str: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>``, or None."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool and float are not allowed
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _walk(node.left, used)
        right = _walk(node.right, used)
        try:
            return _OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise InvalidEquation("division by zero") from exc
    raise InvalidEquation(f"{type(node).__name__} is not allowed (only integers, + - * / and parentheses)")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """Exact value of ``equation`` and the integer literals it uses, in order.

    Raises `InvalidEquation` for anything beyond integers, binary ``+ - * /`` and parentheses (names, calls,
    attributes, unary signs, powers, floats, ...), for division by zero and for unparsable text.
    """
    if len(equation) > _MAX_EQUATION_CHARS:
        raise InvalidEquation(f"equation longer than {_MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(equation, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise InvalidEquation(f"not an expression: {exc}") from exc
    used: list[int] = []
    return _walk(tree, used), used


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0) -> float:
    """1.0 if the last ``<answer>`` equation uses each given number exactly once and equals the target.

    The equation may end in ``= <target>`` ("(6 - 2) * 6 = 24"); the right-hand side must then be the
    target and is not counted as a used number. A response with an ``<answer>`` that is wrong, invalid
    or uses the numbers incorrectly scores ``format_score``; one without ``<answer>`` scores 0.0.
    """
    target, numbers = parse_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    if equation.count("=") == 1:
        equation, claimed = (part.strip() for part in equation.split("="))
        if claimed != str(target):
            return float(format_score)
    try:
        value, used = evaluate_equation(equation)
    except InvalidEquation:
        return float(format_score)
    if sorted(used) != sorted(numbers):
        return float(format_score)
    return 1.0 if value == target else float(format_score)
