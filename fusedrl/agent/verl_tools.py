"""verl-style tool classes run as fusedrl tools.

verl's stateful tools subclass ``verl.tools.base_tool.BaseTool``: built as ``Tool(config, tool_schema)``
from a YAML entry, with coroutine methods

* ``create(instance_id, **kwargs) -> (instance_id, ToolResponse)`` (older versions: just the id),
* ``execute(instance_id, parameters, **kwargs) -> (ToolResponse | str, reward, metrics)``,
* ``calc_reward(instance_id, **kwargs) -> float``,
* ``release(instance_id, **kwargs)``.

verl is not a dependency. A verl tool module ports by changing its imports to this module::

    from fusedrl.agent.verl_tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

`load_tool_config` recognises any class with a coroutine ``execute`` (a subclass of `BaseTool` here or
any class following the same protocol) and wraps an instance in `VerlToolAdapter`, a `fusedrl.agent.Tool`:

* one instance per trajectory and tool: ``create`` before the trajectory's first call of the tool,
  ``release`` when the trajectory ends. The row's ``extra_info.tools_kwargs[name].create_kwargs`` are
  spread as keywords (verl's older rollout) and given as ``create_kwargs=`` (verl's current tool loop), as
  far as ``create``'s signature takes them;
* ``execute`` gets the parsed arguments and the row's ``execute_kwargs``; its reward is added to the
  trajectory's score (as a `fusedrl.agent.ToolResult` reward), its metrics are dropped;
* ``calc_reward`` is not called by the loop (verl's tool loop does not call it either; tools call it
  from ``execute``, as verl's GSM8K tool does);
* responses are text: a response with images or videos is an error observation.

The coroutines of one tool run on one event loop of their own (a daemon thread), so a tool may keep
loop-bound state (clients, sessions) from call to call; the agent runner's thread pool waits for them
with its per-call timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from fusedrl.agent.tools import Tool, ToolConfigError, ToolResult, check_schema


class _Fields:
    """Attribute access over a plain dict (nested dicts too), and ``model_dump()`` back to the dict: what
    verl tool code does with its pydantic schema objects (``self.tool_schema.function.name``)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_data", dict(data))

    def __getattr__(self, name: str) -> Any:
        data = object.__getattribute__(self, "_data")
        if name not in data:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} (fields: {sorted(data)})")
        value = data[name]
        return _Fields(value) if isinstance(value, Mapping) else value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __getitem__(self, name: str) -> Any:
        return object.__getattribute__(self, "_data")[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Fields) and self.model_dump() == other.model_dump()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({object.__getattribute__(self, '_data')!r})"

    def model_dump(self, **_: Any) -> dict[str, Any]:
        """The fields as a plain dict (pydantic's ``exclude_*`` keywords are accepted and ignored)."""
        return json.loads(json.dumps(object.__getattribute__(self, "_data")))


class OpenAIFunctionToolSchema(_Fields):
    """An OpenAI function schema ``{type: function, function: {name, description, parameters}}``, checked
    on construction; ``schema.function.name`` and ``schema.model_dump()`` work as on verl's class."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(check_schema(data, where="tool_schema"))

    @classmethod
    def model_validate(cls, data: Mapping[str, Any]) -> OpenAIFunctionToolSchema:
        return cls(data)


class ToolResponse:
    """What a verl-style tool returns: ``text`` (fusedrl's tools answer in text only)."""

    def __init__(self, text: str | None = None, image: list | None = None, video: list | None = None) -> None:
        self.text = text
        self.image = image
        self.video = video

    def __repr__(self) -> str:
        return f"ToolResponse(text={self.text!r})"


class BaseTool:
    """Base class with verl's ``BaseTool`` protocol (see the module docstring); subclasses override the
    coroutines they need. ``tool_schema`` may instead come from ``get_openai_tool_schema()``."""

    def __init__(self, config: Mapping[str, Any] | None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = as_schema(tool_schema) if tool_schema is not None else None
        if self.tool_schema is None:
            found = self.get_openai_tool_schema()
            self.tool_schema = as_schema(found) if found is not None else None
        if self.tool_schema is None:
            raise ToolConfigError(
                f"tool class {type(self).__name__} has no schema: give tool_schema in the YAML entry "
                "({type: function, function: {name: ..., description: ..., parameters: ...}}) or return one "
                "from get_openai_tool_schema()"
            )
        self.name = str(self.tool_schema.function.name)

    def get_openai_tool_schema(self) -> Any:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return (instance_id if instance_id is not None else uuid.uuid4().hex), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def as_schema(schema: Any) -> OpenAIFunctionToolSchema:
    """An `OpenAIFunctionToolSchema` from a dict, one of ours or any object with ``model_dump()``."""
    if isinstance(schema, OpenAIFunctionToolSchema):
        return schema
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump()
    if not isinstance(schema, Mapping):
        raise ToolConfigError(f"tool_schema must be a mapping, got {type(schema).__name__}: {schema!r}")
    return OpenAIFunctionToolSchema(schema)


def is_verl_tool_class(obj: Any) -> bool:
    """A class following verl's tool protocol: its ``execute`` is a coroutine function."""
    return isinstance(obj, type) and inspect.iscoroutinefunction(getattr(obj, "execute", None))


class _LoopThread:
    """One asyncio event loop on a daemon thread; `run` waits for a coroutine from any other thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _create_call_kwargs(fn: Any, create_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for a verl-style ``create``: the row's create_kwargs spread (verl's older rollout)
    and as ``create_kwargs=`` (its current tool loop), as far as the method's signature takes them."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if "create_kwargs" in params and not var_kw:
        return {"create_kwargs": dict(create_kwargs)}
    if var_kw and "create_kwargs" not in create_kwargs:
        return {**create_kwargs, "create_kwargs": dict(create_kwargs)}
    return dict(create_kwargs)


def _response_text(value: Any, where: str) -> str:
    """The text of what ``execute`` returned (a str, a dict, a ToolResponse-like object)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value)
    if getattr(value, "image", None) or getattr(value, "video", None):
        raise ValueError(f"{where} returned images / videos; fusedrl's tool responses are text only")
    if hasattr(value, "text"):
        return "" if value.text is None else str(value.text)
    return str(value)


class VerlToolAdapter(Tool):
    """Runs an instance of a verl-style tool class (see the module docstring) as a fusedrl `Tool`."""

    def __init__(self, tool: Any) -> None:
        schema = getattr(tool, "tool_schema", None)
        if schema is None and hasattr(tool, "get_openai_tool_schema"):
            schema = tool.get_openai_tool_schema()
        if schema is None:
            raise ToolConfigError(f"{type(tool).__name__}: the tool has no tool_schema")
        super().__init__({}, as_schema(schema).model_dump())
        self.tool = tool
        self.config = dict(getattr(tool, "config", None) or {})
        self._ids: dict[str, str] = {}  # fusedrl instance id -> the id the tool's create returned
        self._loop: _LoopThread | None = None
        self._lock = threading.Lock()

    def _run(self, coro: Any) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread(f"verl-tool-{self.name}")
        return self._loop.run(coro)

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        out = self._run(self.tool.create(instance_id, **_create_call_kwargs(self.tool.create, create_kwargs)))
        got = out[0] if isinstance(out, tuple) else out
        self._ids[instance_id] = str(got) if got is not None else instance_id

    def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        out = self._run(
            self.tool.execute(self._ids.get(instance_id, instance_id), arguments, **execute_kwargs)
        )
        response, reward = (out[0], out[1] if len(out) > 1 else 0.0) if isinstance(out, tuple) else (out, 0.0)
        return ToolResult(_response_text(response, f"{self.name}.execute"), float(reward or 0.0))

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(self._run(self.tool.calc_reward(self._ids.get(instance_id, instance_id), **kwargs)))

    def release(self, instance_id: str) -> None:
        tool_id = self._ids.pop(instance_id, instance_id)
        self._run(self.tool.release(tool_id))

    def __getstate__(self) -> dict[str, Any]:  # the loop thread does not pickle; a copy starts its own
        state = dict(self.__dict__)
        state.update(_loop=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
