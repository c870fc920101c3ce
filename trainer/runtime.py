"""Ray start-up for the trainers: `init_ray` sizes a local runtime; `started_trainer` brings up Ray, a
trainer and its workers for the duration of a ``with`` block (entry points, benchmarks, tests). Both read
the typed run (`fusedrl.run_config.RunConfig`; SFT: `SFTRoleConfigs`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from fusedrl.run_config import RunConfig, as_run_config

if TYPE_CHECKING:
    from fusedrl.sft_role_config import SFTRoleConfigs
    from fusedrl.trainer.ppo_trainer import PPOTrainer


@contextlib.contextmanager
def started_trainer(
    config: RunConfig | DictConfig,
    *,
    trainer_cls: type | None = None,
    compute_score: Any = None,
    role_groups: Sequence[Sequence[str]] | None = None,
    tools: list[Any] | None = None,
) -> Iterator[PPOTrainer]:
    """Ray up (`init_ray`), the trainer built (``trainer_cls``: a user subclass) and its workers started
    (``role_groups``: see `PPOTrainer.init_workers`; ``tools``: Python tools for multi-turn rollouts); on exit
    the workers and trackers are closed, and Ray is shut down if this call started it. ``config``:
    `fusedrl.config.load_config`'s `RunConfig` (a composed DictConfig is typed first)."""
    import ray
    import torch

    run = as_run_config(config)
    owns_ray = not ray.is_initialized()
    init_ray(run)
    kwargs: dict[str, Any] = {} if compute_score is None else {"compute_score": compute_score}
    if tools:
        kwargs["tools"] = tools  # multi-turn agent rollouts: tools given in Python
    trainer = trainer_class(run, trainer_cls)(run, **kwargs)
    threads = torch.get_num_threads()
    # The driver's tensors are one step's rows and its cores are the workers': with several torch threads a
    # small op (indexing a batch's rows) waits at a thread barrier for a core that a worker or another process
    # holds (tiny GRPO step, 2-core EPYC: the driver's CPU 106 -> 71 ms a step; one [64, 64] row index 15 ms ->
    # 20 us while the machine was loaded). The workers keep their own threads (`OMP_NUM_THREADS`).
    torch.set_num_threads(1)
    try:
        trainer.init_workers(role_groups)
        yield trainer
    finally:
        torch.set_num_threads(threads)
        trainer.close()
        if owns_ray:
            ray.shutdown()


def trainer_class(config: RunConfig | DictConfig, trainer_cls: type | None) -> type:
    """The trainer to build: ``trainer_cls`` (a user subclass) if given, else `AsyncPPOTrainer` when
    ``async_training.max_staleness`` > 0, `PartialRolloutTrainer` with ``async_training.partial_rollout``
    and `PPOTrainer` otherwise. A given class must derive from the one the config asks for (ValueError
    naming the key)."""
    from fusedrl.trainer.async_trainer import AsyncPPOTrainer
    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    run = as_run_config(config)
    staleness = run.async_training.max_staleness
    needed: type = PPOTrainer
    setting = ""
    if staleness > 0:
        needed, setting = AsyncPPOTrainer, f"async_training.max_staleness={staleness}"
    elif run.async_training.partial_rollout:
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


def typed_run(config: RunConfig | SFTRoleConfigs | DictConfig) -> RunConfig | SFTRoleConfigs:
    """``config`` typed: a PPO-family `RunConfig`, or the SFT trainer's `SFTRoleConfigs` (its composed
    DictConfig has no ``actor_rollout_ref``)."""
    from fusedrl.sft_role_config import SFTRoleConfigs, build_sft_role_configs

    if isinstance(config, (RunConfig, SFTRoleConfigs)):
        return config
    if "actor_rollout_ref" in config:
        return RunConfig.of(config)
    from fusedrl.config import to_plain_dict

    return build_sft_role_configs(to_plain_dict(config), total_steps=1)


def run_slots(config: RunConfig | SFTRoleConfigs | DictConfig) -> int:
    """Device slots the run reserves: every pool's (RL trainer, ``trainer.placement``), or
    ``trainer.nnodes x trainer.n_gpus_per_node`` (SFT trainer, which has no placement section)."""
    run = typed_run(config)
    if not isinstance(run, RunConfig):
        return run.trainer.nnodes * run.trainer.n_gpus_per_node
    from fusedrl.placement_config import read_placement

    placement = read_placement(dataclasses.asdict(run.trainer))
    return sum(placement.pools[p].world_size for p in {"global", *placement.role_pool.values()})


def init_ray(config: RunConfig | SFTRoleConfigs | DictConfig) -> None:
    """Start a local Ray runtime sized for the run (no dashboard; workers get the engine env vars), or
    join the running cluster at ``RAY_ADDRESS`` (several machines, docs/placement.md)."""
    import ray

    if ray.is_initialized():
        return
    run = typed_run(config)
    num_cpus = run.trainer.ray_num_cpus or max(os.cpu_count() or 1, run_slots(run))
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's INFO lines (one per request batch, per reload) would drown the per-step log.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    user_kwargs: Any = None  # trainer.ray_init (verl's ray_kwargs.ray_init.*): the user's ray.init arguments
    if isinstance(run, RunConfig):  # an SFT run has no engine, plugins or ray_init
        from fusedrl.config import import_plugin
        from fusedrl.workers.rollout.registry import engine_traits

        for module in run.algorithm.custom_modules:
            import_plugin(module)  # an engine registered there (idempotent with the config check)
        env = {**dict(engine_traits(run.rollout.name).worker_env), **env}
        user_kwargs = dict(run.trainer.ray_init or {})
    for key in ("PYTHONPATH", "HF_HUB_OFFLINE", "OMP_NUM_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    from fusedrl.ray_config import ray_init_kwargs

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
        "object_store_memory": int(float(run.trainer.ray_object_store_gb) * (1 << 30)),
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
