"""Load a user's reward function from a Python file (``custom_reward_function.path`` / ``.name``)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_FUNCTION_NAME = "compute_score"


def _module_name(path: Path) -> str:
    # One stable name per file, so that objects defined in it pickle the same way in every process.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    return f"fusedrl_custom_reward_{path.stem.replace('-', '_').replace('.', '_')}_{digest}"


def load_custom_reward_function(
    path: str | Path, name: str | None = DEFAULT_FUNCTION_NAME
) -> Callable[..., Any]:
    """Import the file at ``path`` and return its function ``name`` (``compute_score`` when None/empty).

    The function is expected as ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
    (a dict holds the reward under ``"score"``). For ``reward_model.reward_manager=batch`` it instead takes
    lists: ``fn(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]``.

    Raises FileNotFoundError (no such file), ImportError (the file fails to import; the cause is chained)
    and AttributeError / TypeError (no such function / not callable), each naming the file and function.
    """
    name = name or DEFAULT_FUNCTION_NAME
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"custom reward file not found: {str(path)!r} (custom_reward_function.path; resolved to "
            f"{file.resolve()})"
        )
    file = file.resolve()
    module_name = _module_name(file)
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(
            f"custom reward file {file} cannot be imported as a Python module (is it a .py file?)"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing custom reward file {file} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, name):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and not isinstance(v, type)
        )
        raise AttributeError(
            f"custom reward file {file} has no function {name!r} (custom_reward_function.name); "
            f"functions defined there: {defined}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {file} is a {type(fn).__name__}, not a function")
    return fn


class FileRewardFunction:
    """A reward function named by ``(path, name)``: callable, and picklable by that name.

    Pickling sends only the path and name; the receiving process imports the file itself on first use.
    This is what lets a function from a user's file run in ``spawn`` / ``forkserver`` worker processes.
    """

    def __init__(self, path: str | Path, name: str | None = DEFAULT_FUNCTION_NAME) -> None:
        self.path = str(Path(path).expanduser().resolve())  # worker processes may run elsewhere
        self.name = name or DEFAULT_FUNCTION_NAME
        self._fn: Callable[..., Any] | None = None

    def load(self) -> Callable[..., Any]:
        if self._fn is None:
            self._fn = load_custom_reward_function(self.path, self.name)
        return self._fn

    def warm_up(self) -> None:
        """Import the file now (worker processes call this before taking samples)."""
        self.load()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FileRewardFunction, (self.path, self.name))

    def __repr__(self) -> str:
        return f"FileRewardFunction({self.path!r}, {self.name!r})"
