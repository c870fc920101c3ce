"""Name -> function registries for advantage estimators and policy losses.

The trainer only ever looks functions up by the string found in its config, so a new algorithm is a
decorated function in any imported module (or a file named by ``load_function``) and no trainer edit.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ADV_ESTIMATOR_KEY = "algorithm.adv_estimator"
POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"

_ADV_ESTIMATORS: dict[str, Callable[..., Any]] = {}
_POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    # A module imported twice (e.g. reloaded in a notebook) re-registers an equivalent function;
    # that must not count as a clash, while two different functions under one name must.
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        existing = table.get(name)
        if existing is not None and not _same_function(existing, fn):
            raise ValueError(
                f"{kind} {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pick another name"
            )
        table[name] = fn
        return fn

    return decorator


def register_adv_estimator(name: str) -> Callable[[F], F]:
    """Decorator registering a function as the advantage estimator called ``name``.

    No paper: registry plumbing. The function must take
    ``(token_level_rewards [B, T], response_mask [B, T], index, **kwargs)`` and return
    ``(advantages [B, T], returns [B, T])``. Registering a different function under a taken name
    raises ValueError.
    """
    return _register(_ADV_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator registering a function as the policy loss called ``name``.

    No paper: registry plumbing. The function must take
    ``(log_prob, old_log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, loss_agg_mode, global_norm)`` and return ``(loss scalar, metrics dict)``.
    Registering a different function under a taken name raises ValueError.
    """
    return _register(_POLICY_LOSSES, "policy loss", name)


def _ensure_builtins_loaded() -> None:
    # The built-in functions register themselves on import; importing here lets a caller use the
    # getters without remembering to import the algorithm modules first.
    importlib.import_module("fusedrl.algorithms.advantages")
    importlib.import_module("fusedrl.algorithms.losses")
    importlib.import_module("fusedrl.algorithms.more_losses")


def _lookup(
    table: dict[str, Callable[..., Any]], name: str, kind: str, key: str, decorator: str
) -> Callable[..., Any]:
    _ensure_builtins_loaded()
    fn = table.get(name)
    if fn is None:
        known = ", ".join(sorted(table)) or "<none>"
        raise ValueError(
            f"Unknown {kind} {name!r} (config key `{key}`). Known: {known}. "
            f"Register a new one with @{decorator}(name) in an imported module."
        )
    return fn


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """Return the advantage estimator registered as ``name``; ValueError naming the config key if unknown.

    No paper: registry plumbing.
    """
    return _lookup(_ADV_ESTIMATORS, name, "advantage estimator", ADV_ESTIMATOR_KEY, "register_adv_estimator")


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Return the policy loss registered as ``name``; ValueError naming the config key if unknown.

    No paper: registry plumbing.
    """
    return _lookup(_POLICY_LOSSES, name, "policy loss", POLICY_LOSS_KEY, "register_policy_loss")


def list_adv_estimators() -> list[str]:
    """Sorted names of all registered advantage estimators. No paper: registry plumbing."""
    _ensure_builtins_loaded()
    return sorted(_ADV_ESTIMATORS)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses. No paper: registry plumbing."""
    _ensure_builtins_loaded()
    return sorted(_POLICY_LOSSES)


def _load_module_from_file(path: str) -> Any:
    abspath = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abspath):
        raise ImportError(f"load_function: file {abspath!r} does not exist")
    # A name derived from the absolute path keeps two same-named files in different folders apart
    # and lets a repeated load reuse the module instead of re-running its registrations.
    mod_name = "fusedrl_user_" + "".join(c if c.isalnum() else "_" for c in abspath)
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, abspath)
    if spec is None or spec.loader is None:
        raise ImportError(f"load_function: cannot build an import spec for file {abspath!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise ImportError(f"load_function: importing file {abspath!r} failed: {exc!r}") from exc
    return module


def load_function(dotted: str) -> Callable[..., Any]:
    """Import and return the callable named by ``dotted``.

    No paper: plumbing for user-supplied reward / advantage / loss functions named in a config.
    Accepted forms: ``pkg.mod:func``, ``pkg.mod.func`` and ``/path/to/file.py:func`` (a relative
    ``file.py:func`` is resolved against the current directory). Errors name the path that failed.
    """
    if not isinstance(dotted, str) or not dotted.strip():
        raise ValueError(f"load_function: expected 'pkg.mod:func' or '/path/file.py:func', got {dotted!r}")
    spec = dotted.strip()
    if ":" in spec:
        # rsplit so that a Windows drive letter or a ':' inside a directory name stays in the path.
        target, attr = spec.rsplit(":", 1)
    elif "." in spec:
        target, attr = spec.rsplit(".", 1)
    else:
        raise ValueError(
            f"load_function: {spec!r} names no module; use 'pkg.mod:func' or '/path/file.py:func'"
        )
    if not target or not attr:
        raise ValueError(f"load_function: {spec!r} is missing the module/file or the function name")

    is_file = target.endswith(".py") or os.sep in target or "/" in target
    if is_file:
        module = _load_module_from_file(target)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ImportError(
                f"load_function: cannot import module {target!r} (from {spec!r}): {exc}"
            ) from exc

    fn = getattr(module, attr, None)
    if fn is None:
        raise AttributeError(f"load_function: {target!r} has no attribute {attr!r} (from {spec!r})")
    if not callable(fn):
        raise TypeError(f"load_function: {spec!r} resolves to a non-callable {type(fn).__name__}")
    return fn
