"""Load a user's reward function from a Python file (``custom_reward_function.path`` / ``.name``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusedrl.plugins import get_callable, load_file

DEFAULT_FUNCTION_NAME = "compute_score"


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
    module = load_file(file)
    return get_callable(module, name, f"custom reward file {file.resolve()} (custom_reward_function.name)")


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
