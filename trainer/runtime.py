"""Ray start-up for the trainers: `init_ray` sizes a local runtime; `started_trainer` brings up Ray, a
trainer and its workers for the duration of a ``with`` block (entry points, benchmarks, tests)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from fusedrl.trainer.ppo_trainer import PPOTrainer


@contextlib.contextmanager
def started_trainer(
    config: DictConfig,
    *,
    trainer_cls: type | None = None,
    compute_score: Any = None,
    role_groups: Sequence[Sequence[str]] | None = None,
    tools: list[Any] | None = None,
) -> Iterator[PPOTrainer]:
    """Ray up (`init_ray`), the trainer built (``trainer_cls``: a user subclass) and its workers started
    (``role_groups``: see `PPOTrainer.init_workers`; ``tools``: Python tools for multi-turn rollouts); on exit the workers and trackers are closed, and Ray
    is shut down if this call started it."""
    import ray

    owns_ray = not ray.is_initialized()
    init_ray(config)
    kwargs: dict[str, Any] = {} if compute_score is None else {"compute_score": compute_score}
    if tools:
        kwargs["tools"] = tools  # multi-turn agent rollouts: tools given in Python
    trainer = trainer_class(config, trainer_cls)(config, **kwargs)
    try:
        trainer.init_workers(role_groups)
        yield trainer
    finally:
        trainer.close()
        if owns_ray:
            ray.shutdown()


def trainer_class(config: DictConfig, trainer_cls: type | None) -> type:
    """The trainer to build: ``trainer_cls`` (a user subclass) if given, else `AsyncPPOTrainer` when
    ``async_training.max_staleness`` > 0, `PartialRolloutTrainer` with ``async_training.partial_rollout``
    and `PPOTrainer` otherwise. A given class must derive from the one the config asks for (ValueError
    naming the key)."""
    from fusedrl.trainer.async_trainer import AsyncPPOTrainer
    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    staleness = int(config.async_training.max_staleness)
    needed: type = PPOTrainer
    setting = ""
    if staleness > 0:
        needed, setting = AsyncPPOTrainer, f"async_training.max_staleness={staleness}"
    elif bool(config.async_training.partial_rollout):
        needed, setting = PartialRolloutTrainer, "async_training.partial_rollout=true"
    if trainer_cls is None:
        return needed
    if not issubclass(trainer_cls, needed):
        module = needed.__module__
        raise ValueError(
            f"{setting} needs a subclass of {needed.__name__} ({module}), got {trainer_cls.__name__}; "
            f"derive from {needed.__name__} or turn {setting.split('=')[0]} off."
        )
    return trainer_cls


def run_slots(config: DictConfig) -> int:
    """Device slots the run reserves: every pool's (RL trainer, ``trainer.placement``), or
    ``trainer.nnodes x trainer.n_gpus_per_node`` (SFT trainer, which has no placement section)."""
    if "placement" not in config.trainer:
        return int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    from fusedrl.placement_config import read_placement

    placement = read_placement(config.trainer)
    return sum(placement.pools[p].world_size for p in {"global", *placement.role_pool.values()})


def init_ray(config: DictConfig) -> None:
    """Start a local Ray runtime sized for the run (no dashboard; workers get the engine env vars), or
    join the running cluster at ``RAY_ADDRESS`` (several machines, docs/placement.md)."""
    import ray

    if ray.is_initialized():
        return
    num_cpus = config.trainer.ray_num_cpus or max(os.cpu_count() or 1, run_slots(config))
    from omegaconf import OmegaConf

    from fusedrl.workers.rollout.registry import engine_traits

    engine = OmegaConf.select(config, "actor_rollout_ref.rollout.name", default=None)  # none in SFT runs
    for module in OmegaConf.select(config, "algorithm.custom_modules", default=None) or []:
        from fusedrl.config import import_plugin

        import_plugin(str(module))  # an engine registered there (idempotent with the config check)
    env = {
        **(dict(engine_traits(engine).worker_env) if engine is not None else {}),
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's INFO lines (one per request batch, per reload) would drown the per-step log.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    for key in ("PYTHONPATH", "HF_HUB_OFFLINE", "OMP_NUM_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    from fusedrl.ray_config import ray_init_kwargs

    # trainer.ray_init (verl's ray_kwargs.ray_init.*): the user's ray.init arguments over fusedrl's
    user = config.trainer.get("ray_init")
    user_kwargs: Any = OmegaConf.to_container(user, resolve=True) if user is not None else None
    if os.environ.get("RAY_ADDRESS"):  # a running (multi-node) cluster: join it as it is sized
        ray.init(
            **ray_init_kwargs(
                {"runtime_env": {"env_vars": env}, "logging_level": logging.WARNING}, user_kwargs
            )
        )
        return
    preload = tcmalloc_preload()
    if preload:  # local workers only: another node may keep the library elsewhere or not at all
        env["LD_PRELOAD"] = preload
    base = {
        "num_cpus": int(num_cpus),
        "include_dashboard": False,
        "object_store_memory": int(float(config.trainer.ray_object_store_gb) * (1 << 30)),
        "runtime_env": {"env_vars": env},
        "logging_level": logging.WARNING,
    }
    ray.init(**ray_init_kwargs(base, user_kwargs))


# Where Debian/Ubuntu (libtcmalloc-minimal4, libgoogle-perftools4) and RPM distributions put the library.
_TCMALLOC_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
)
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def tcmalloc_preload() -> str | None:
    """``LD_PRELOAD`` for a local worker process: `tcmalloc_path` ahead of this process's own preloads, or
    None where there is no tcmalloc to preload."""
    path = tcmalloc_path()
    if not path:
        return None
    return ":".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)


def tcmalloc_path() -> str | None:
    """The tcmalloc library the local Ray workers preload (``LD_PRELOAD``), or None.

    On a CPU-only machine the training step allocates and frees large activation and gradient buffers
    many times a step; glibc's malloc returns them to the system and faults them back in each time,
    tcmalloc keeps them (measured: 5-6% off a bf16 GRPO step, 9-10% off its update; docs/architecture.md).
    ``FUSEDRL_TCMALLOC`` decides: unset or ``auto``, the first library found in the system's library directories, and only
    where no CUDA device is visible; ``0`` never; a path, that file on any machine (FileNotFoundError,
    naming the variable, when it does not exist)."""
    choice = os.environ.get("FUSEDRL_TCMALLOC", "auto").strip()
    if choice.lower() in ("0", "off", "false", "no"):
        return None
    if choice.lower() not in ("", "auto", "1", "on", "true", "yes"):
        if not os.path.isfile(choice):
            raise FileNotFoundError(
                f"FUSEDRL_TCMALLOC={choice}: no such file; give the path of libtcmalloc_minimal.so.4, "
                "or set FUSEDRL_TCMALLOC=auto (look for it) or 0 (glibc malloc)."
            )
        return choice
    import torch

    if torch.cuda.is_available():
        return None
    for folder in _TCMALLOC_DIRS:
        for name in _TCMALLOC_NAMES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None
