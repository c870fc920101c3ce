"""Tools an agent loop can call: plain typed functions and stateful classes (`Tool`).

A *function tool* is any Python function with type hints and a docstring; its OpenAI-style JSON schema
(``{"type": "function", "function": {"name", "description", "parameters"}}``) is derived from them. An
``Args:`` section in the docstring (Google style) describes the parameters.

A *class tool* subclasses `Tool` and keeps per-trajectory state: ``create(instance_id, **create_kwargs)``
when a trajectory starts, ``execute(instance_id, arguments, **execute_kwargs)`` per call,
``release(instance_id)`` when the trajectory ends. Per-row keyword arguments come from the dataset's
``extra_info.tools_kwargs[tool_name]`` (``create_kwargs`` / ``execute_kwargs``), verl's convention.

The run's tools by name, and verl-format YAML tool files: `fusedrl.agent.toolset`.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class ToolConfigError(ValueError):
    """A tool definition that cannot be used; the message names the file / entry and the fix."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one call returns: the observation text and an optional reward added to the trajectory's score."""

    text: str
    reward: float = 0.0


class Tool:
    """Base class of stateful tools. Subclasses implement `execute`; `create` / `release` are optional.

    ``config`` is the YAML entry's ``config`` mapping; ``tool_schema`` its OpenAI-style schema, which a
    subclass may instead define as the class attribute ``schema``.
    """

    schema: dict[str, Any] | None = None

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        schema = dict(tool_schema) if tool_schema is not None else self.schema
        if schema is None:
            raise ToolConfigError(
                f"tool class {type(self).__name__} has no schema: give tool_schema in the YAML entry or set "
                "the class attribute `schema` ({'type': 'function', 'function': {'name': ...}})"
            )
        self.schema = check_schema(schema, where=type(self).__name__)

    @property
    def name(self) -> str:
        assert self.schema is not None
        return str(self.schema["function"]["name"])

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        """Start per-trajectory state (called once per trajectory before any call)."""

    def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult | str:
        raise NotImplementedError

    def release(self, instance_id: str) -> None:
        """Drop per-trajectory state (called once when the trajectory ends, whatever happened)."""


class FunctionTool(Tool):
    """A stateless tool made from a plain function; ``arguments`` become its keyword arguments."""

    def __init__(self, fn: Callable[..., Any], tool_schema: Mapping[str, Any] | None = None) -> None:
        self.fn = fn
        super().__init__({}, tool_schema if tool_schema is not None else function_schema(fn))
        self._params = inspect.signature(fn).parameters

    def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult | str:
        unknown = sorted(set(arguments) - set(self._params))
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in self._params.values()):
            raise TypeError(f"unknown argument(s) {unknown}; {self.name} takes {sorted(self._params)}")
        out = self.fn(**{**execute_kwargs, **arguments})
        return out if isinstance(out, ToolResult) else str(out)


_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin in (dict, Mapping):
        return {"type": "object"}
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {**_json_type(type(values[0])), "enum": values}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0])
    raise ToolConfigError(
        f"cannot derive a JSON schema type from the annotation {annotation!r}; use str, int, float, bool, "
        "list[...], dict or Literal[...], or pass tool_schema explicitly"
    )


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The description (text before ``Args:``) and per-parameter descriptions from a Google-style docstring."""
    doc = inspect.cleandoc(doc)
    head, _, rest = doc.partition("\nArgs:")
    params: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if re.match(r"^\S", line):  # a new top-level section (Returns:, Raises:) ends Args
            break
        m = re.match(r"^\s+(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            current = m.group(1)
            params[current] = m.group(3).strip()
        elif current and line.strip():
            params[current] += " " + line.strip()
    return " ".join(head.split()), params


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI-style function schema from ``fn``'s name, type hints and docstring."""
    name = getattr(fn, "__name__", None)
    doc = inspect.getdoc(fn)
    if not name or not doc:
        raise ToolConfigError(
            f"{fn!r}: a function tool needs a name and a docstring (its description for the model)"
        )
    description, param_docs = _docstring_parts(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname not in hints:
            raise ToolConfigError(
                f"{name}: parameter {pname!r} has no type hint; annotate it (e.g. `{pname}: int`)"
            )
        prop = _json_type(hints[pname])
        if pname in param_docs:
            prop["description"] = param_docs[pname]
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def check_schema(schema: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Validate the shape of an OpenAI function schema; returns it as a plain dict."""
    plain: dict[str, Any] = plain_value(schema) if isinstance(schema, Mapping) else {}
    fn = plain.get("function")
    if plain.get("type") == "function" and isinstance(fn, dict) and not fn.get("name"):
        raise ToolConfigError(
            f"{where}: tool_schema.function has no name; add function.name (the name the model calls the "
            f"tool by), got {schema!r}"
        )
    if plain.get("type") != "function" or not isinstance(fn, dict):
        raise ToolConfigError(
            f"{where}: tool_schema must look like {{type: function, function: {{name: ..., description: ..., "
            f"parameters: {{type: object, properties: ...}}}}}}, got {schema!r}"
        )
    fn.setdefault("parameters", {"type": "object", "properties": {}})
    return plain


def plain_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    return value


def as_tool(obj: Any) -> Tool:
    """A `Tool` from a `Tool` instance or a plain function."""
    if isinstance(obj, Tool):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return FunctionTool(obj)
    raise ToolConfigError(f"{obj!r} is not a tool: pass a Tool instance or a typed function with a docstring")
