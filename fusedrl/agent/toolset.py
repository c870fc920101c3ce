"""The tools of one run (`ToolSet`): Python tools passed to the trainer and the tools of a verl-format YAML file.

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
import os
from collections.abc import Iterable, Mapping
from typing import Any

from fusedrl.agent.tools import FunctionTool, Tool, ToolConfigError, as_tool, check_schema, plain_value
from fusedrl.agent.verl_tools import OpenAIFunctionToolSchema, VerlToolAdapter, is_verl_tool_class


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
    raw = plain_value(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
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
