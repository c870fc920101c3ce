"""Checks of a composed trainer config (`validate`): every problem collected into one `ConfigError`, each
naming the key, the bad value and the fix, before Ray starts. `fusedrl.config` loads the config and calls this.

Each typed section checks its own fields (``problems()`` beside them: `fusedrl.model_sections`,
`fusedrl.run_sections`); the checks that need two sections or more are `fusedrl.config_cross_checks`."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from fusedrl.config_base import ConfigError, missing_keys, unset_as_none

# ``algorithm`` first: its ``custom_modules`` import may register the estimators, losses and engines that
# the other sections' checks look up.
SECTION_ORDER = (
    "algorithm", "data", "trainer", "model", "actor", "ref", "rollout", "critic", "reward_model",
    "custom_reward_function", "async_training",
)  # fmt: skip


def validate(cfg: DictConfig) -> None:
    """Check a composed config; raise one `ConfigError` listing every problem (every section's, then the
    cross-section ones), each once."""
    from fusedrl.config_cross_checks import cross_section_problems
    from fusedrl.config_sections import budget_interpolations
    from fusedrl.role_config import RunSections, written_sections

    problems = [
        f"`{key}`: required, not set. Pass `{key}=...` on the command line." for key in missing_keys(cfg)
    ]
    plain = OmegaConf.to_container(unset_as_none(cfg), resolve=True)
    run = RunSections(**written_sections(plain))  # type: ignore[arg-type]
    for name in SECTION_ORDER:
        problems.extend(getattr(run, name).problems())
    # the raw tree is read once more only for which token budgets interpolate another key (the typed
    # sections hold resolved values; a budget's problem names the key it follows)
    problems.extend(cross_section_problems(run, budget_interpolations(cfg)))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
