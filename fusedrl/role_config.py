"""The typed configs the roles receive: one keyword-only frozen dataclass per YAML section.

The driver validates the composed config (`fusedrl.config_checks.validate`), then turns it ONCE into a
`RoleConfigs` (`build_role_configs`; SFT: `fusedrl.sft_role_config.build_sft_role_configs`) and hands that to every worker. The
roles read attributes (``cfg.actor.optim.lr``), never ``config["..."]`` dicts, and values the driver
derives (the tokenizer's eos / pad ids, Python agent tools, the SFT step count) are fields of their own,
not keys smuggled into the config.

The field names are the YAML's keys, section by section and recursively, with no defaults here: the YAML
(``trainer/config/ppo_trainer.yaml`` / ``sft_trainer.yaml``) is the one place defaults live, and
``tests/unit/test_role_config.py`` checks that every YAML key is a field and every field a YAML key.
The objects are plain (no OmegaConf inside: lists become tuples, mappings plain dicts), so Ray pickles
them to the actors, and this module imports nothing heavy (the GPU check builds workers without omegaconf).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusedrl.agent.runner import MultiTurnConfig
from fusedrl.model_sections import (
    ATTN_IMPLEMENTATIONS,
    ROLLOUT_MODES,
    SLEEP_LEVELS,
    ActorConfig,
    ActorFsdpConfig,
    CheckpointContents,
    CriticConfig,
    CriticModelConfig,
    FsdpConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RefFsdpConfig,
    RolloutConfig,
    TurboConfig,
    TurboDistributed,
    ValKwargs,
    expert_parallel_size,
)
from fusedrl.run_sections import (
    AlgorithmConfig,
    AsyncTrainingConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OverlongBufferConfig,
    PlacementSection,
    RewardModelConfig,
    RewardModelFsdpConfig,
    RewardModelPath,
    RolloutCorrectionConfig,
    TrainerConfig,
)

# The sections live in `fusedrl.model_sections` and `fusedrl.run_sections`; this module is their import name.
__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "ActorConfig",
    "ActorFsdpConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CheckpointContents",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "FsdpConfig",
    "KLControlConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PlacementSection",
    "PolicyLossConfig",
    "ROLLOUT_MODES",
    "RefConfig",
    "RefFsdpConfig",
    "RewardModelConfig",
    "RewardModelFsdpConfig",
    "RewardModelPath",
    "RoleConfigs",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunSections",
    "SLEEP_LEVELS",
    "Section",
    "TokenIds",
    "TrainerConfig",
    "TurboConfig",
    "TurboDistributed",
    "ValKwargs",
    "build_role_configs",
    "build_section",
    "expert_parallel_size",
    "records_routed_experts",
    "run_config",
    "written_sections",
]

Section = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class TokenIds:
    """Token ids the driver reads from the tokenizer (the rollouts stop on ``eos`` and pad with ``pad``)."""

    eos: int
    pad: int


# ---------------------------------------------------------------------- what a worker receives
@dataclass(frozen=True, kw_only=True)
class RunSections:
    """A PPO-family run's YAML sections, typed (``actor_rollout_ref`` split into ``model`` / ``actor`` /
    ``ref`` / ``rollout``): what the driver's `fusedrl.run_config.RunConfig` and the workers' `RoleConfigs`
    both hold."""

    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig
    critic: CriticConfig
    reward_model: RewardModelConfig
    custom_reward_function: CustomRewardFunctionConfig
    data: DataConfig
    algorithm: AlgorithmConfig
    async_training: AsyncTrainingConfig
    trainer: TrainerConfig

    def needed_roles(self) -> dict[str, bool]:
        """Which optional roles the run builds (``ref``, ``critic``, ``reward_model``: on or off)."""
        import fusedrl.algorithms  # noqa: F401  (registers the built-in estimators)
        from fusedrl.algorithms.registry import roles_for

        use_kl = bool(self.actor.use_kl_loss or self.algorithm.use_kl_in_reward)
        return roles_for(
            str(self.algorithm.adv_estimator), use_kl=use_kl, reward_model=bool(self.reward_model.enable)
        )


@dataclass(frozen=True, kw_only=True)
class RoleConfigs(RunSections):
    """Everything a PPO-family worker's roles read: the run's sections plus the values the driver derives."""

    tokens: TokenIds
    agent_tools: tuple[Any, ...]  # tools passed in Python to the trainer (agentic rollouts)
    total_steps: int | None  # the run's planned steps (`model.compile_layers=auto` reads it); None: unknown

    def with_slots(self, *, nnodes: int, n_gpus_per_node: int) -> RoleConfigs:
        """The same configs for a pool of another size (its workers' rendezvous and device index)."""
        trainer = dataclasses.replace(self.trainer, nnodes=nnodes, n_gpus_per_node=n_gpus_per_node)
        return dataclasses.replace(self, trainer=trainer)


# The top-level YAML sections of `RoleConfigs` other than ``actor_rollout_ref`` (split by role above).
_PPO_SECTIONS = {
    "critic": CriticConfig,
    "reward_model": RewardModelConfig,
    "custom_reward_function": CustomRewardFunctionConfig,
    "data": DataConfig,
    "algorithm": AlgorithmConfig,
    "async_training": AsyncTrainingConfig,
    "trainer": TrainerConfig,
}
_ARR_SECTIONS = {"model": ModelConfig, "actor": ActorConfig, "ref": RefConfig, "rollout": RolloutConfig}


def _plain(value: Any) -> Any:
    """Lists (at any depth outside a mapping) become tuples: the configs are immutable values."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def build_section(cls: type, node: Section, where: str) -> Any:
    """``cls`` from one YAML section ``node`` (a plain mapping, interpolations resolved), recursively for
    nested sections. Raises KeyError naming ``where.key`` for a key the section lacks; keys the dataclass
    does not know are ignored here (``fusedrl.config_checks.validate`` has reported them already)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name not in node:
            raise KeyError(f"`{where}.{field.name}` is missing from the config given to the workers")
        value = node[field.name]
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            kwargs[field.name] = build_section(hint, value, f"{where}.{field.name}")  # type: ignore[arg-type]
        elif isinstance(value, Mapping):
            kwargs[field.name] = dict(value)  # a free-form mapping (reward_kwargs, env_config, pools)
        else:
            kwargs[field.name] = _plain(value)
    return cls(**kwargs)


def written_sections(config: Section) -> dict[str, Any]:
    """`RunSections`' fields from the resolved PPO config as a plain dict, typed but as written (verl's
    global micro-batch sizes not yet split): what the config checks read (each section's ``problems()``)."""
    arr = config["actor_rollout_ref"]
    sections = {
        name: build_section(cls, arr[name], f"actor_rollout_ref.{name}")
        for name, cls in _ARR_SECTIONS.items()
    }
    sections.update({name: build_section(cls, config[name], name) for name, cls in _PPO_SECTIONS.items()})
    return sections


def build_role_configs(
    config: Section, *, tokens: TokenIds, agent_tools: Any = (), total_steps: int | None = None
) -> RoleConfigs:
    """The workers' `RoleConfigs` from the resolved PPO config as a plain dict
    (``fusedrl.config.to_plain_dict``), the tokenizer's ids, any Python agent tools and the planned steps
    (the trainer counts them from the data). ``auto`` keys stay ``auto``: each worker resolves them for its
    own device (`fusedrl.auto_defaults`)."""
    sections = written_sections(config)
    # verl's global micro-batch keys, split over each role's data-parallel ranks (`fusedrl.micro_batches`;
    # the problems were reported by `load_config`, and a size that cannot be split is left as written).
    from fusedrl.micro_batches import per_rank_micro_batches, yaml_prefix

    def written(name: str) -> Any:
        node: Any = config
        for part in yaml_prefix(name).split("."):
            node = node[part]
        return node

    sizes, _ = per_rank_micro_batches(written, config["trainer"])
    for (name, field), size in sizes.items():
        sections[name] = dataclasses.replace(sections[name], **{field: size})
    return RoleConfigs(
        **sections, tokens=tokens, agent_tools=tuple(agent_tools or ()), total_steps=total_steps
    )


def run_config(
    config: Any, *, tokens: TokenIds | None = None, agent_tools: Any = (), total_steps: int | None = None
) -> RoleConfigs:
    """The composed (validated) DictConfig, or a `fusedrl.run_config.RunConfig`, as the typed `RoleConfigs`
    the workers receive, ``auto`` keys unresolved; ``tokens`` (0, 0) when no tokenizer is at hand (tests)."""
    from omegaconf import OmegaConf

    tokens = tokens or TokenIds(eos=0, pad=0)
    if not OmegaConf.is_config(config):  # a RunConfig: typed already
        return config.roles(tokens=tokens, agent_tools=agent_tools, total_steps=total_steps)
    plain: Any = OmegaConf.to_container(config, resolve=True)
    return build_role_configs(plain, tokens=tokens, agent_tools=agent_tools, total_steps=total_steps)


def records_routed_experts(rollout: RolloutConfig) -> bool:
    """Whether the engine records each token's experts (`fusedrl.third_party.vllm.routed_experts`)."""
    return bool(rollout.enable_rollout_routing_replay or rollout.record_routed_experts)
