"""One loader for user code named in a config: a module by dotted name, or a Python file by path.

Every extension point that takes user code goes through here: ``algorithm.custom_modules`` (modules
imported for the estimators / losses they register), ``custom_reward_function.path`` and any
``pkg.mod:func`` / ``/path/file.py:func`` string given to `load_function`.

A file gets a module name derived from its absolute path (stem + a hash of the path), so two files with
the same name in different folders are two modules (each one's registrations run), while loading the same
file twice reuses the module (its registrations run once). The name is the same in every process, so
objects defined in the file pickle by that name across Ray workers and reward pools.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def file_module_name(path: str | Path) -> str:
    """The module name a user file is imported under: ``fusedrl_user_<stem>_<hash of its absolute path>``."""
    abspath = Path(path).expanduser().resolve()
    digest = hashlib.sha1(str(abspath).encode()).hexdigest()[:12]
    stem = "".join(c if c.isalnum() else "_" for c in abspath.stem)
    return f"fusedrl_user_{stem}_{digest}"


def is_file_spec(target: str) -> bool:
    """A target names a file (not a dotted module) when it ends in .py or contains a path separator."""
    return target.endswith(".py") or os.sep in target or "/" in target


def load_file(path: str | Path) -> ModuleType:
    """Import the Python file at ``path`` (once per absolute path). Errors name the file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no such Python file: {str(path)!r} (resolved to {file.resolve()})")
    file = file.resolve()
    name = file_module_name(file)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file} cannot be imported as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ImportError(f"importing {file} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_module(target: str) -> ModuleType:
    """Import ``pkg.module`` or the file ``/path/file.py``; the module is returned (imported once)."""
    if is_file_spec(target):
        try:
            return load_file(target)
        except FileNotFoundError as exc:  # one exception type for "cannot import" whatever the form
            raise ImportError(str(exc)) from exc
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise ImportError(f"cannot import module {target!r}: {exc}") from exc


def split_function_spec(spec: str) -> tuple[str, str]:
    """``pkg.mod:func`` / ``pkg.mod.func`` / ``/path/file.py:func`` -> (module or file, function name)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"expected 'pkg.mod:func' or '/path/file.py:func', got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        # rsplit so that a ':' inside a directory name stays in the path.
        target, attr = spec.rsplit(":", 1)
    elif "." in spec and not spec.endswith(".py"):
        target, attr = spec.rsplit(".", 1)
    else:
        raise ValueError(f"{spec!r} names no function; use 'pkg.mod:func' or '/path/file.py:func'")
    if not target or not attr:
        raise ValueError(f"{spec!r} is missing the module/file or the function name")
    return target, attr


def get_callable(module: ModuleType, attr: str, where: str) -> Callable[..., Any]:
    """``module.attr``, checked to exist and be callable; errors list what the module does define."""
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and not isinstance(v, type)
        )
        raise AttributeError(f"{where} has no function {attr!r}; functions defined there: {defined}")
    if not callable(fn):
        raise TypeError(f"{attr!r} in {where} is a {type(fn).__name__}, not a function")
    return fn


def load_function(spec: str) -> Callable[..., Any]:
    """Import and return the callable named by ``pkg.mod:func``, ``pkg.mod.func`` or ``/path/file.py:func``."""
    target, attr = split_function_spec(spec)
    return get_callable(load_module(target), attr, repr(target))
