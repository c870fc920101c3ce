"""Load the trainer config (Hydra YAML + command-line overrides) and validate it before Ray starts.

The YAML under ``fusedrl/trainer/config`` is the single source of truth for keys and defaults. Every
problem found is collected and reported in one `ConfigError`, each naming the key, the bad value and the
fix, so a user fixes a command line once instead of once per crash. `load_config` returns the run typed
(`fusedrl.run_config.RunConfig`); `compose_config` returns the composed DictConfig (any config name).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from fusedrl.config_base import (
    CONFIG_DIR,
    ConfigError,
    all_keys,
    config_dir,
    import_plugin,
    logger_names,
    needed_roles,
    to_plain_dict,
    trainer_yaml,
)

if TYPE_CHECKING:
    from fusedrl.run_config import RunConfig

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "cli_main",
    "compose_config",
    "import_plugin",
    "load_config",
    "logger_names",
    "needed_roles",
    "role_configs_from_overrides",
    "to_plain_dict",
    "trainer_yaml",
]


def _unknown_override_keys(base: DictConfig, overrides: Sequence[str]) -> list[str]:
    known = set(all_keys(base))
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


def _section_of(cfg: DictConfig) -> Callable[[str], Any]:
    """A `RoleConfigs` section's node by its field name (``actor`` is ``actor_rollout_ref.actor``)."""
    from fusedrl.micro_batches import yaml_prefix

    return lambda name: OmegaConf.select(cfg, yaml_prefix(name), throw_on_missing=False) or {}


def _print_line(line: str) -> None:
    print(line, flush=True)


def load_config(
    overrides: Sequence[str] = (),
    validate_config: bool = True,
    report: Callable[[str], None] = _print_line,
) -> RunConfig:
    """The PPO-family run from ``ppo_trainer.yaml`` and ``key=value`` overrides (verl's accepted), typed: a
    `RunConfig` whose ``source`` is the composed DictConfig. Every problem is raised at once in one
    `ConfigError` before anything is built (`compose_config`); unless ``validate_config`` is false, the
    typed sections hold checked values."""
    from fusedrl.run_config import RunConfig

    return RunConfig.of(compose_config(overrides, "ppo_trainer", validate_config, report))


def compose_config(
    overrides: Sequence[str] = (),
    config_name: str = "ppo_trainer",
    validate_config: bool = True,
    report: Callable[[str], None] = _print_line,
) -> DictConfig:
    """Compose ``config_name`` with Hydra-style ``key=value`` overrides; validate unless told not to.

    For the PPO trainer, verl's command lines are accepted as they are (`fusedrl.verl_compat`): verl keys
    that have no effect here, and ``+key`` overrides that nothing reads, are dropped or kept and named
    in one line passed to ``report`` (printed by default); values fusedrl cannot run are problems.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fusedrl import verl_compat

    folder = str(config_dir())
    pre_problems: list[str] = []
    ignored: list[tuple[str, str]] = []
    overrides = list(overrides)
    if config_name == "ppo_trainer":
        overrides, pre_problems = verl_compat.config_name_flags(overrides)
    base = OmegaConf.load(os.path.join(folder, f"{config_name}.yaml"))
    assert isinstance(base, DictConfig)
    if config_name == "ppo_trainer":
        overrides, ignored, verl_problems = verl_compat.map_overrides(base, overrides)
        pre_problems.extend(verl_problems)
    unknown = [*pre_problems, *_unknown_override_keys(base, overrides)]
    bad_keys = {p.split("`")[1] for p in unknown if p.startswith("`")}
    usable = [ov for ov in overrides if ov.split("=", 1)[0] not in bad_keys]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=folder, version_base=None):
            cfg = compose(config_name=config_name, overrides=usable)
    except Exception as err:  # Hydra's parse / type errors: report them like every other problem
        raise ConfigError([*unknown, f"command line: {err}".replace("\n", " ")]) from err
    problems = list(unknown)
    if config_name == "ppo_trainer":  # verl's global micro-batches: split per role (derived, not written)
        from fusedrl.micro_batches import per_rank_micro_batches

        problems.extend(per_rank_micro_batches(_section_of(cfg), cfg.trainer)[1])
    if ignored:
        report(verl_compat.format_no_effect(ignored))
    if validate_config:
        from fusedrl.config_checks import validate

        try:
            validate(cfg)
        except ConfigError as err:
            problems.extend(err.problems)
        if not problems:
            from fusedrl.cpu_dtype import apply_cpu_dtype_policy

            try:  # bf16 on a CPU without bf16 instructions: float32 with a message, or refused
                apply_cpu_dtype_policy(cfg)
            except ConfigError as err:
                problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def cli_main(
    argv: Sequence[str] | None,
    load: Callable[[list[str]], Any],
    run: Callable[[Any], Any],
    *,
    prog: str = "fusedrl",
    show_config: bool = True,
) -> int:
    """The body of every entry point: ``key=value`` overrides -> validated config (a `RunConfig` or, SFT,
    a DictConfig) -> ``run(config)``.

    Config problems are all printed at once to stderr, before anything starts, and the exit code is 2.
    A run stopped by SIGTERM / SIGINT (checkpointed; rerunning resumes) exits with 75
    (``fusedrl.controller.preemption.PREEMPTED_EXIT_CODE``).
    """
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        config = load(overrides)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    if show_config:
        from fusedrl.run_config import RunConfig

        print(OmegaConf.to_yaml(config.source if isinstance(config, RunConfig) else config), flush=True)
    from fusedrl.controller.preemption import Preempted

    try:
        run(config)
    except Preempted as err:  # SIGTERM / SIGINT: checkpointed and stopped cleanly; rerunning resumes
        print(f"{prog}: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


def role_configs_from_overrides(
    overrides: Sequence[str] = (), *, tokens: Any = None, config_name: str = "ppo_trainer"
) -> Any:
    """The YAML + ``key=value`` overrides (not validated) as the typed configs a worker receives: for tests
    and benchmarks that build roles or workers without the trainer. ``config_name`` ``sft_trainer`` gives
    `SFTRoleConfigs` (``total_steps`` 1); ``tokens``: a `TokenIds` ((0, 0) when None). The ``auto`` keys
    are resolved for this process's device, where such callers build their roles
    (`fusedrl.auto_defaults`; a worker resolving them again changes nothing)."""
    from fusedrl.auto_defaults import local_facts, resolve_configs
    from fusedrl.role_config import TokenIds, build_role_configs

    plain = to_plain_dict(compose_config(list(overrides), config_name=config_name, validate_config=False))
    if config_name == "sft_trainer":
        from fusedrl.sft_role_config import build_sft_role_configs

        built: Any = build_sft_role_configs(plain, total_steps=1)
    else:
        built = build_role_configs(plain, tokens=tokens or TokenIds(eos=0, pad=0))
    return resolve_configs(built, local_facts())[0]
