"""The config's leaf pieces, imported by the config's checks and readers without importing the loader
(`fusedrl.config`, which imports the checks): `ConfigError`, the YAML, the role set, the loggers, user
modules. `fusedrl.config` re-exports them."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "trainer" / "config"


class ConfigError(ValueError):
    """All problems of a config, one per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} config problem(s):\n{lines}")


def config_dir() -> Path:
    """The folder of the trainer YAMLs."""
    # Installed layout: fusedrl/trainer/config; source layout: trainer/config next to fusedrl/. Located
    # without importing the trainer package (it imports the trainer, and the trainer this module).
    spec = importlib.util.find_spec("fusedrl.trainer")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover
        return CONFIG_DIR
    return Path(list(spec.submodule_search_locations)[0]).resolve() / "config"


def all_keys(cfg: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    if isinstance(cfg, DictConfig):
        for k in cfg:
            full = f"{prefix}{k!s}"
            keys.append(full)
            node = cfg._get_node(k)
            if isinstance(node, DictConfig):
                keys.extend(all_keys(node, full + "."))
    return keys


def trainer_yaml(config_name: str = "ppo_trainer") -> DictConfig:
    """The YAML's keys and defaults, without overrides (not validated; ``???`` left missing)."""
    base = OmegaConf.load(os.path.join(str(config_dir()), f"{config_name}.yaml"))
    assert isinstance(base, DictConfig)
    return base


def import_plugin(spec: str) -> None:
    """Import a user module for the estimators / losses it registers: ``pkg.module`` or ``/path/file.py``
    (once per module; two files with the same name in different folders are two modules)."""
    from fusedrl.plugins import load_module

    load_module(spec)


def needed_roles(cfg: DictConfig) -> dict[str, bool]:
    """Which optional roles the fused workers must build (`fusedrl.algorithms.registry.roles_for`), for a
    caller holding a DictConfig; the config checks and the trainer ask the typed sections
    (`RunSections.needed_roles`)."""
    import fusedrl.algorithms  # noqa: F401  (registers the built-in estimators)
    from fusedrl.algorithms.registry import roles_for

    alg = cfg.algorithm
    use_kl = bool(cfg.actor_rollout_ref.actor.use_kl_loss or alg.use_kl_in_reward)
    return roles_for(str(alg.adv_estimator), use_kl=use_kl, reward_model=bool(cfg.reward_model.enable))


def logger_names(cfg: Any) -> list[str]:
    """``trainer.logger`` of a DictConfig or a typed config, as a list (a bare ``trainer.logger=console`` is
    accepted too)."""
    value = cfg.trainer.logger
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def missing_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Keys set to ``???``. Interpolations to them (``${...}``) are not resolved, so each missing key is
    reported once, under its own name."""
    out: list[str] = []
    if isinstance(cfg, DictConfig):
        for k in cfg:
            node = cfg._get_node(k)
            full = f"{prefix}{k!s}"
            if isinstance(node, DictConfig):
                out.extend(missing_keys(node, full + "."))
            elif node is not None and not node._is_interpolation() and node._is_missing():
                out.append(full)
    return out


def unset_as_none(cfg: DictConfig) -> DictConfig:
    """``cfg`` with its unset keys (``???``) None, in a copy (``cfg`` itself when none is unset), so that it
    resolves: the keys that interpolate them are None too."""
    unset = missing_keys(cfg)
    if not unset:
        return cfg
    filled = cfg.copy()
    for key in unset:
        OmegaConf.update(filled, key, None, force_add=True)
    return filled


def to_plain_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config (a DictConfig, or a `fusedrl.run_config.RunConfig`'s ``source``) as plain Python
    containers."""
    out = OmegaConf.to_container(cfg if OmegaConf.is_config(cfg) else cfg.source, resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
