"""Load the trainer config (Hydra YAML + command-line overrides) and validate it before Ray starts.

The YAML under ``fusedrl/trainer/config`` is the single source of truth for keys and defaults. Every
problem found is collected and reported in one `ConfigError`, each naming the key, the bad value and the
fix, so a user fixes a command line once instead of once per crash.
"""

from __future__ import annotations

import difflib
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


def _config_dir() -> Path:
    # Installed layout: fusedrl/trainer/config; source layout: trainer/config next to fusedrl/.
    try:
        import fusedrl.trainer as trainer_pkg

        return Path(trainer_pkg.__file__).resolve().parent / "config"
    except ImportError:  # pragma: no cover
        return CONFIG_DIR


def _all_keys(cfg: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    if isinstance(cfg, DictConfig):
        for k in cfg.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            node = cfg._get_node(k)
            if isinstance(node, DictConfig):
                keys.extend(_all_keys(node, full + "."))
    return keys


def _unknown_override_keys(base: DictConfig, overrides: Sequence[str]) -> list[str]:
    known = set(_all_keys(base))
    problems = []
    for ov in overrides:
        if ov.startswith(("+", "~", "hydra.")) or "=" not in ov:
            continue
        key = ov.split("=", 1)[0]
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" Did you mean `{close[0]}`?" if close else " Add it with `+key=value` if it is new."
            problems.append(f"`{key}`: unknown key.{hint}")
    return problems


def load_config(overrides: Sequence[str] = (), config_name: str = "ppo_trainer", validate_config: bool = True) -> DictConfig:
    """Compose ``config_name`` with Hydra-style ``key=value`` overrides; validate unless told not to."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = str(_config_dir())
    base = OmegaConf.load(os.path.join(config_dir, f"{config_name}.yaml"))
    problems = _unknown_override_keys(base, overrides)
    if problems:
        raise ConfigError(problems)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    if validate_config:
        validate(cfg)
    return cfg


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def validate(cfg: DictConfig) -> None:
    """Check a composed config; raise one `ConfigError` listing every problem."""
    from fusedrl.algorithms import list_adv_estimators, list_policy_losses
    from fusedrl.algorithms.losses import LOSS_AGG_MODES as AGG_MODES

    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    for key in OmegaConf.missing_keys(cfg):
        problems.append(f"`{key}`: required, not set. Pass `{key}=...` on the command line.")

    # --- paths
    files = _get(cfg, "data.train_files")
    if files is not None and not OmegaConf.is_missing(cfg.data, "train_files"):
        for f in [files] if isinstance(files, str) else list(files):
            need(os.path.exists(f), f"`data.train_files`: file `{f}` does not exist. Generate it (see examples/data_preprocess/) or fix the path.")
    val_files = _get(cfg, "data.val_files")
    if val_files:
        for f in [val_files] if isinstance(val_files, str) else list(val_files):
            need(os.path.exists(f), f"`data.val_files`: file `{f}` does not exist.")
    if not OmegaConf.is_missing(cfg.actor_rollout_ref.model, "path"):
        path = cfg.actor_rollout_ref.model.path
        need(
            os.path.isfile(os.path.join(str(path), "config.json")),
            f"`actor_rollout_ref.model.path`: `{path}` is not a Hugging Face model folder (no config.json). "
            "Point it at a local folder; build a tiny one with `python -m fusedrl.utils.tiny_model --out DIR`.",
        )

    # --- batch-size arithmetic
    world = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    n = int(cfg.actor_rollout_ref.rollout.n)
    bsz = int(cfg.data.train_batch_size)
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    micro = int(cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu)
    need(world >= 1, f"`trainer.n_gpus_per_node` x `trainer.nnodes` = {world}: need at least one device slot.")
    need(n >= 1, f"`actor_rollout_ref.rollout.n`={n}: must be >= 1.")
    need(bsz >= 1, f"`data.train_batch_size`={bsz}: must be >= 1.")
    need(micro >= 1, f"`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`={micro}: must be >= 1.")
    if world >= 1 and n >= 1 and bsz >= 1 and mini >= 1:
        need(
            (bsz * n) % world == 0,
            f"`data.train_batch_size` x `actor_rollout_ref.rollout.n` = {bsz * n} samples do not divide across "
            f"{world} workers. Make train_batch_size * n a multiple of {world}.",
        )
        need(
            bsz % mini == 0,
            f"`actor_rollout_ref.actor.ppo_mini_batch_size`={mini} does not divide `data.train_batch_size`={bsz}. "
            "Use a divisor of train_batch_size.",
        )
        need(
            (mini * n) % world == 0,
            f"`actor_rollout_ref.actor.ppo_mini_batch_size` x n = {mini * n} samples per mini-batch do not divide "
            f"across {world} workers. Make ppo_mini_batch_size * n a multiple of {world}.",
        )
    else:
        need(mini >= 1, f"`actor_rollout_ref.actor.ppo_mini_batch_size`={mini}: must be >= 1.")
    need(int(cfg.data.max_prompt_length) > 0, "`data.max_prompt_length`: must be > 0.")
    need(int(cfg.data.max_response_length) > 0, "`data.max_response_length`: must be > 0.")
    need(cfg.data.truncation in ("filter", "error"), f"`data.truncation`={cfg.data.truncation!r}: use `filter` or `error`.")

    # --- algorithm names
    est = cfg.algorithm.adv_estimator
    need(est in list_adv_estimators(), f"`algorithm.adv_estimator`={est!r}: unknown. Known: {', '.join(list_adv_estimators())}.")
    if est in ("grpo", "rloo") and n < 2:
        problems.append(
            f"`actor_rollout_ref.rollout.n`={n}: `{est}` compares samples of the same prompt, so every advantage "
            "would be 0. Use n >= 2."
        )
    actor = cfg.actor_rollout_ref.actor
    mode = actor.policy_loss.loss_mode
    need(mode in list_policy_losses(), f"`actor_rollout_ref.actor.policy_loss.loss_mode`={mode!r}: unknown. Known: {', '.join(list_policy_losses())}.")
    need(actor.loss_agg_mode in AGG_MODES, f"`actor_rollout_ref.actor.loss_agg_mode`={actor.loss_agg_mode!r}: unknown. Known: {', '.join(AGG_MODES)}.")
    need(
        actor.kl_loss_type in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"),
        f"`actor_rollout_ref.actor.kl_loss_type`={actor.kl_loss_type!r}: use k1, k2, k3 (low_var_kl) or abs.",
    )
    need(float(actor.optim.lr) > 0, f"`actor_rollout_ref.actor.optim.lr`={actor.optim.lr}: must be > 0.")

    # --- rollout
    rollout = cfg.actor_rollout_ref.rollout
    need(rollout.name in ("vllm", "hf"), f"`actor_rollout_ref.rollout.name`={rollout.name!r}: use `vllm` or `hf`.")
    need(
        int(rollout.tensor_model_parallel_size) == 1,
        f"`actor_rollout_ref.rollout.tensor_model_parallel_size`={rollout.tensor_model_parallel_size}: only 1 "
        "(data-parallel rollout) is supported in this release. Set it to 1.",
    )
    need(float(rollout.temperature) > 0, f"`actor_rollout_ref.rollout.temperature`={rollout.temperature}: must be > 0 for training rollouts.")
    if rollout.name == "vllm":
        from fusedrl.third_party.vllm import vllm_available

        need(vllm_available(), "`actor_rollout_ref.rollout.name`=vllm but `import vllm` fails here. Run `make install` or use `rollout.name=hf`.")

    loggers = list(cfg.trainer.logger)
    for name in loggers:
        need(name in ("console", "jsonl"), f"`trainer.logger`: unknown logger {name!r}. Known: console, jsonl.")

    if problems:
        raise ConfigError(problems)


def to_plain_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python containers (what crosses into the workers)."""
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
