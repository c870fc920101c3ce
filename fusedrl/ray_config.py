"""``trainer.ray_init`` (verl's ``ray_kwargs.ray_init.*``): keyword arguments for ``ray.init``, checked
before Ray starts and merged with what fusedrl passes itself (`fusedrl.trainer.runtime.init_ray`).

fusedrl sizes the local Ray runtime (``num_cpus`` from ``trainer.ray_num_cpus``, ``object_store_memory``
from ``trainer.ray_object_store_gb``) and gives every worker environment variables; a key given here
replaces fusedrl's value, except ``runtime_env``, which is merged (its ``env_vars`` added to fusedrl's).
``runtime_env.py_executable`` is the command Ray starts each worker's Python with (verl's scripts pass
``uv run ...``): its program must be on ``PATH``, and for ``uv run`` the extras it names must be extras of
the project ``uv`` will find (the ``pyproject.toml`` at or above the working directory).
"""

from __future__ import annotations

import inspect
import os
import shlex
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KEY = "trainer.ray_init"
VERL_KEY = "ray_kwargs.ray_init"


def _named(key: str) -> str:
    return f"`{KEY}.{key}` (verl: {VERL_KEY}.{key})"


def ray_init_parameters() -> set[str]:
    """The keyword parameters of this Ray's ``ray.init`` (its ``**kwargs`` excluded)."""
    import ray

    params = inspect.signature(ray.init).parameters.values()
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}


def ray_init_problems(ray_init: Mapping[Any, Any] | None, cwd: str | None = None) -> list[str]:
    """Every problem of ``trainer.ray_init``: a name ``ray.init`` does not take, a ``py_executable`` whose
    program is not on PATH, a ``uv run`` whose extras or lock file the project lacks."""
    if not ray_init:
        return []
    problems: list[str] = []
    known = ray_init_parameters()
    for name in ray_init:
        if name not in known:
            problems.append(
                f"{_named(str(name))}: ray.init has no parameter {name!r}. Its parameters: {', '.join(sorted(known))}."
            )
    env = ray_init.get("runtime_env")
    if env is None:
        return problems
    if not isinstance(env, Mapping):
        return [*problems, f"{_named('runtime_env')}={env!r}: use a mapping (Ray's runtime_env)."]
    exe = env.get("py_executable")
    if exe is not None:
        problems.extend(_py_executable_problems(str(exe), cwd or os.getcwd()))
    return problems


def _py_executable_problems(exe: str, cwd: str) -> list[str]:
    key = _named("runtime_env.py_executable")
    try:
        words = shlex.split(exe)
    except ValueError as err:
        return [f"{key}={exe!r}: cannot be split into words ({err})."]
    if not words:
        return [f"{key}: empty; set it to null (workers run this Python) or to a command."]
    program = words[0]
    if shutil.which(program) is None:
        return [
            f"{key}={exe!r}: `{program}` is not on PATH here, so Ray could not start its workers. Install "
            f"{program}, or set {VERL_KEY}.runtime_env.py_executable=null (workers run this Python)."
        ]
    if Path(program).name == "uv" and "run" in words:
        return _uv_run_problems(words[words.index("run") + 1 :], exe, key, Path(cwd))
    return []


def _uv_run_problems(args: list[str], exe: str, key: str, cwd: Path) -> list[str]:
    """``uv run`` resolves the project at or above the working directory: the extras it is asked for must be
    that project's, and ``--frozen`` / ``--locked`` need its ``uv.lock``."""
    extras = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--extra"]
    extras += [a.split("=", 1)[1] for a in args if a.startswith("--extra=")]
    project = next((d for d in (cwd, *cwd.parents) if (d / "pyproject.toml").is_file()), None)
    if project is None:
        return []  # uv runs the script without a project
    problems: list[str] = []
    if extras:
        import tomllib

        data = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
        have = sorted(data.get("project", {}).get("optional-dependencies", {}))
        missing = [e for e in extras if e not in have]
        if missing:
            problems.append(
                f"{key}={exe!r}: `uv run` resolves {project / 'pyproject.toml'}, which has no extra "
                f"{', '.join(missing)} (its extras: {', '.join(have) or 'none'}); verl's scripts name verl's "
                "extras. Name this project's extras, or set it to null (workers run this Python)."
            )
    if any(a in ("--frozen", "--locked") for a in args) and not (project / "uv.lock").is_file():
        problems.append(
            f"{key}={exe!r}: --frozen / --locked need {project / 'uv.lock'}, which does not exist (run `uv lock` "
            "there), or drop the flag."
        )
    return problems


def ray_init_kwargs(base: dict[str, Any], ray_init: Mapping[Any, Any] | None) -> dict[str, Any]:
    """``base`` (fusedrl's ray.init arguments) with ``ray_init`` applied: its keys replace fusedrl's, its
    ``runtime_env`` is merged into fusedrl's (``env_vars`` added); null values are left out."""
    out = dict(base)
    for name, value in (ray_init or {}).items():
        if name == "runtime_env" and isinstance(value, Mapping):
            env = dict(out.get("runtime_env") or {})
            for env_key, env_value in value.items():
                if env_value is None:
                    continue
                if env_key == "env_vars" and isinstance(env_value, Mapping):
                    env["env_vars"] = {**env.get("env_vars", {}), **{k: str(v) for k, v in env_value.items()}}
                else:
                    env[env_key] = env_value
            out["runtime_env"] = env
        elif value is not None:
            out[name] = value
    return out
