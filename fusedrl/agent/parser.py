"""Tool-call parsing: the Hermes / Qwen format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(slots=True)
class ToolCall:
    """One parsed call. ``error`` is set (and ``name`` / ``arguments`` may be empty) when it is malformed."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order.

    A block whose body is not a JSON object with a string ``name`` and an object ``arguments`` (a JSON
    string holding an object is accepted too) yields a `ToolCall` with ``error`` set, so the model gets an
    error observation instead of silence. An opening tag without a closing one is reported the same way.
    """
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        calls.append(_parse_one(body.strip()))
    tail = _CALL.sub("", text)
    if "<tool_call>" in tail:
        calls.append(ToolCall(error="unterminated <tool_call> block (no </tool_call>)"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(error=f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(obj, dict):
        return ToolCall(error=f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error='tool call has no "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=name, error='"arguments" is a string that is not a JSON object')
    if not isinstance(args, dict):
        return ToolCall(name=name, error=f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name=name, arguments=args)
