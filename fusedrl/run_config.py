"""The typed run config: what `fusedrl.config.load_config` returns for a PPO-family run.

`RunConfig` holds the run's sections as the frozen dataclasses of `fusedrl.role_config` (``actor_rollout_ref``
split into ``model`` / ``actor`` / ``ref`` / ``rollout``; verl's global micro-batch sizes already split over each
role's data-parallel ranks), built once from the composed, checked config, and that config itself as
``source`` (a DictConfig: `PPOTrainer.config`, the tracker's copy, users' subclasses reading keys). The driver
reads the sections; the workers receive `RunConfig.roles`, the same sections plus the values only the trainer
knows (the tokenizer's ids, Python agent tools, the planned steps).

An attribute the sections do not hold (``run.actor_rollout_ref``) is looked up in ``source``, so code written
against the DictConfig that reads keys by attribute keeps working; the sections themselves are immutable
(pass ``key=value`` overrides to `load_config` instead of assigning).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusedrl.role_config import RoleConfigs, RunSections, TokenIds, run_config

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig(RunSections):
    """A composed, checked PPO-family run: its typed sections and the DictConfig they were built from."""

    source: DictConfig = dataclasses.field(repr=False, compare=False)  # the composed config, as composed

    @classmethod
    def of(cls, config: DictConfig) -> RunConfig:
        """The typed sections of a composed PPO config (``auto`` keys unresolved: each worker resolves them).
        A config loaded without validation may leave keys unset (``???``): they, and the keys that
        interpolate them, are None in the sections (the DictConfig keeps them as written)."""
        from fusedrl.config_base import unset_as_none

        roles = run_config(unset_as_none(config))
        return cls(**{name: getattr(roles, name) for name in section_names()}, source=config)

    def roles(
        self,
        *,
        tokens: TokenIds | None = None,
        agent_tools: Iterable[Any] = (),
        total_steps: int | None = None,
    ) -> RoleConfigs:
        """What the workers receive: the sections plus the driver's values (``tokens`` (0, 0) when no
        tokenizer is at hand)."""
        sections = {name: getattr(self, name) for name in section_names()}
        return RoleConfigs(
            **sections,
            tokens=tokens or TokenIds(eos=0, pad=0),
            agent_tools=tuple(agent_tools),
            total_steps=total_steps,
        )

    def __getattr__(self, name: str) -> Any:
        """A key the sections do not hold (``actor_rollout_ref``): ``source``'s, as the DictConfig reads it."""
        source = self.__dict__.get("source")
        if source is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(source, name)


def section_names() -> tuple[str, ...]:
    """`RunConfig`'s typed sections (`RunSections`' fields)."""
    return tuple(f.name for f in dataclasses.fields(RunSections))


def as_run_config(config: RunConfig | DictConfig) -> RunConfig:
    """``config`` typed: a `RunConfig` as it is, a composed PPO DictConfig (users' code) built into one."""
    return config if isinstance(config, RunConfig) else RunConfig.of(config)


def dict_config(config: RunConfig | DictConfig) -> DictConfig:
    """The composed DictConfig behind ``config`` (``config`` itself when it is one)."""
    return config.source if isinstance(config, RunConfig) else config
