"""Tools an agent loop can call: plain typed functions, stateful classes, verl-format YAML.

A *function tool* is any Python function with type hints and a docstring; its OpenAI-style JSON schema
(``{"type": "function", "function": {"name", "description", "parameters"}}``) is derived from them. An
``Args:`` section in the docstring (Google style) describes the parameters.

A *class tool* subclasses `Tool` and keeps per-trajectory state: ``create(instance_id, **create_kwargs)``
when a trajectory starts, ``execute(instance_id, arguments, **execute_kwargs)`` per call,
``release(instance_id)`` when the trajectory ends. Per-row keyword arguments come from the dataset's
``extra_info.tools_kwargs[tool_name]`` (``create_kwargs`` / ``execute_kwargs``), verl's convention.

The YAML file named by ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` uses verl's layout::

    tools:
      - class_name: my_pkg.tools.Calculator    # a Tool subclass, a verl-style tool class
                                               # (fusedrl.agent.verl_tools), or a plain function
        config: {precision: 3}                 # passed to the class's constructor
        tool_schema:                           # optional for functions (derived when absent)
          type: function
          function: {name: calculator, description: ..., parameters: {...}}
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import typing
from collections.abc import Callable, Iterable, Mapping
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
    plain: dict[str, Any] = _plain(schema) if isinstance(schema, Mapping) else {}
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


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def as_tool(obj: Any) -> Tool:
    """A `Tool` from a `Tool` instance or a plain function."""
    if isinstance(obj, Tool):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return FunctionTool(obj)
    raise ToolConfigError(f"{obj!r} is not a tool: pass a Tool instance or a typed function with a docstring")


def _import(path: str, where: str, base_dir: str) -> Any:
    """``pkg.mod.Name`` (verl's form), or ``file.py:Name`` with the file relative to ``base_dir`` (the tool
    YAML's folder) unless absolute; files load through `fusedrl.plugins` (one module per full path)."""
    from fusedrl import plugins

    if ".py:" in path:
        file, _, attr = path.rpartition(":")
        file = file if os.path.isabs(file) else os.path.join(base_dir, file)
        try:
            return getattr(plugins.load_file(file), attr)
        except (OSError, ImportError, AttributeError) as exc:
            raise ToolConfigError(f"{where}: cannot load {path!r} ({type(exc).__name__}: {exc})") from exc
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ToolConfigError(
            f"{where}: class_name {path!r} must be a dotted path like my_pkg.tools.Calculator "
            "or a file like tools.py:Calculator"
        )
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        hint = ""
        if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "verl":
            hint = (
                ". verl is not installed and fusedrl does not ship verl's own tools: copy the tool into your "
                "package and import BaseTool, ToolResponse and OpenAIFunctionToolSchema from "
                "fusedrl.agent.verl_tools instead of verl.tools.*"
            )
        raise ToolConfigError(f"{where}: cannot import {path!r} ({type(exc).__name__}: {exc}){hint}") from exc


def load_tool_config(path: str | os.PathLike) -> list[Tool]:
    """Tools listed in a verl-format YAML file (see the module docstring)."""
    from omegaconf import OmegaConf

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ToolConfigError(
            f"{path}: tool config not found (actor_rollout_ref.rollout.multi_turn.tool_config_path)"
        )
    from fusedrl.agent.verl_tools import OpenAIFunctionToolSchema, VerlToolAdapter, is_verl_tool_class

    raw = _plain(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(
            f"{path}: expected a top-level `tools:` list of {{class_name, config, tool_schema}}"
        )
    tools: list[Tool] = []
    for k, entry in enumerate(entries):
        where = f"{path}: tools[{k}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ToolConfigError(
                f"{where}: each entry needs class_name (a dotted path or file.py:Name of a Tool class or function)"
            )
        target = _import(str(entry["class_name"]), where, os.path.dirname(os.path.abspath(path)))
        schema = entry.get("tool_schema")
        if schema is not None:
            schema = check_schema(schema, where=f"{where}.tool_schema")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}: config must be a mapping, got {config!r}")
        if config.get("type", "native") != "native":
            raise ToolConfigError(
                f"{where}: config.type={config['type']!r}: only native tools (Python classes and functions) "
                "are supported; set type: native or drop it"
            )
        if isinstance(target, type) and issubclass(target, Tool):
            tools.append(target(config, schema))
        elif is_verl_tool_class(target):
            try:
                instance = target(
                    config=config, tool_schema=OpenAIFunctionToolSchema(schema) if schema else None
                )
            except ToolConfigError as exc:
                raise ToolConfigError(f"{where}: {exc}") from exc
            tools.append(VerlToolAdapter(instance))
        elif callable(target) and not isinstance(target, type):
            if {k: v for k, v in config.items() if k != "type"}:
                raise ToolConfigError(
                    f"{where}: a function tool takes no config; remove it or use a Tool class"
                )
            tools.append(FunctionTool(target, schema))
        else:
            raise ToolConfigError(
                f"{where}: {entry['class_name']} is neither a fusedrl.agent.Tool subclass, a verl-style tool "
                "class (async create / execute / release, e.g. a fusedrl.agent.verl_tools.BaseTool subclass) "
                "nor a function"
            )
    return tools


class ToolSet:
    """The tools of one run, by name."""

    def __init__(self, tools: Iterable[Any] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        for obj in tools:
            self.add(obj)

    def add(self, obj: Any) -> Tool:
        tool = as_tool(obj)
        if tool.name in self.tools:
            raise ToolConfigError(f"two tools are named {tool.name!r}; tool names must be unique")
        self.tools[tool.name] = tool
        return tool

    def schemas(self) -> list[dict[str, Any]]:
        """The schemas, in the form chat templates take as ``tools=``."""
        return [t.schema for t in self.tools.values() if t.schema is not None]

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def __len__(self) -> int:
        return len(self.tools)

    @classmethod
    def from_config(cls, multi_turn: Mapping[str, Any] | None, extra: Iterable[Any] = ()) -> ToolSet:
        """Tools of the YAML file in ``multi_turn.tool_config_path`` (if any) plus ``extra`` from Python."""
        out = cls(extra)
        path = (multi_turn or {}).get("tool_config_path")
        if path:
            for tool in load_tool_config(str(path)):
                out.add(tool)
        return out
