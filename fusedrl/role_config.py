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

Section = Mapping[str, Any]


# ---------------------------------------------------------------------- shared pieces
@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """``actor_rollout_ref.actor.optim`` and ``critic.optim``: AdamW and its learning-rate schedule."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float
    warmup_style: str | None
    lr_scheduler_type: str
    min_lr_ratio: float
    num_cycles: float


@dataclass(frozen=True, kw_only=True)
class FsdpConfig:
    """A trained model's ``fsdp_config`` (actor, critic): dtypes and the offload switches."""

    model_dtype: str
    param_dtype: str | None  # or "auto" (fusedrl.auto_defaults), resolved on the worker
    param_offload: bool
    optimizer_offload: bool


@dataclass(frozen=True, kw_only=True)
class TurboDistributed:
    """``fsdp_config.turbo_config.distributed`` (verl's FSDP-turbo names): the one key fusedrl reads."""

    # the ranks each MoE layer's experts are spread over (fusedrl.workers.expert_parallel)
    expert_parallel_size: int


@dataclass(frozen=True, kw_only=True)
class TurboConfig:
    """``fsdp_config.turbo_config`` of the actor and the reference."""

    distributed: TurboDistributed


@dataclass(frozen=True, kw_only=True)
class ActorFsdpConfig(FsdpConfig):
    """``actor_rollout_ref.actor.fsdp_config``: a trained model's, and the expert-parallel size."""

    turbo_config: TurboConfig


@dataclass(frozen=True, kw_only=True)
class RefFsdpConfig:
    """``actor_rollout_ref.ref.fsdp_config``: a frozen model has no optimizer to offload."""

    model_dtype: str
    param_dtype: str | None  # or "auto"
    param_offload: bool
    turbo_config: TurboConfig


def expert_parallel_size(fsdp_cfg: Any) -> int:
    """A role's expert-parallel size: ``turbo_config.distributed.expert_parallel_size``, 1 where the role's
    ``fsdp_config`` has none (the critic, SFT)."""
    turbo = getattr(fsdp_cfg, "turbo_config", None)
    return int(turbo.distributed.expert_parallel_size) if turbo is not None else 1


@dataclass(frozen=True, kw_only=True)
class TokenIds:
    """Token ids the driver reads from the tokenizer (the rollouts stop on ``eos`` and pad with ``pad``)."""

    eos: int
    pad: int


# ---------------------------------------------------------------------- actor_rollout_ref
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")  # model.attn_implementation


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """``actor_rollout_ref.model``: the policy's checkpoint, its forward, and LoRA (docs/lora.md)."""

    path: str
    enable_gradient_checkpointing: bool
    use_remove_padding: bool | str  # "auto" until the worker resolves it (fusedrl.auto_defaults)
    share_prompt_prefix: bool
    attn_implementation: str
    compile_layers: bool | str  # the same
    lora_rank: int
    lora_alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    lora_adapter_path: str | None


@dataclass(frozen=True, kw_only=True)
class CheckpointContents:
    """``actor_rollout_ref.actor.checkpoint``."""

    save_contents: tuple[str, ...]
    load_contents: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """``actor_rollout_ref.actor.policy_loss``: the loss and the keys some losses read."""

    loss_mode: str
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """``actor_rollout_ref.actor``: the PPO update of the policy."""

    strategy: str
    ppo_mini_batch_size: int
    ppo_micro_batch_size: int | None
    ppo_micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    ppo_epochs: int
    freeze_vision_tower: bool
    ulysses_sequence_parallel_size: int
    old_log_prob_from_update: bool
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    clip_ratio_c: float
    tau_pos: float
    tau_neg: float
    loss_agg_mode: str
    loss_scale_factor: float | None
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    grad_clip: float
    checkpoint: CheckpointContents
    policy_loss: PolicyLossConfig
    optim: OptimConfig
    fsdp_config: ActorFsdpConfig


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """``actor_rollout_ref.ref``: the frozen reference's log-prob pass."""

    log_prob_micro_batch_size: int | None
    log_prob_micro_batch_size_per_gpu: int
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    fsdp_config: RefFsdpConfig


@dataclass(frozen=True, kw_only=True)
class ValKwargs:
    """``actor_rollout_ref.rollout.val_kwargs``: sampling for validation."""

    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    n: int


ROLLOUT_MODES = ("sync", "async")  # rollout.mode: the in-process engine runs the same way for both
SLEEP_LEVELS = (1, 2, "auto")  # rollout.sleep_level


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """``actor_rollout_ref.rollout``: the engine, its sampling and its old-log-prob pass."""

    name: str
    mode: str
    n: int
    temperature: float
    top_p: float
    top_k: int
    dtype: str
    seed: int
    log_prob_micro_batch_size: int | None
    log_prob_micro_batch_size_per_gpu: int
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    tensor_model_parallel_size: int
    gpu_memory_utilization: float
    cpu_kv_cache_gb: float
    free_cache_engine: bool
    sleep_level: int | str  # "auto" until the worker resolves it (`fusedrl.auto_defaults`)
    emulate_sleep: bool
    enable_prefix_caching: bool
    max_num_seqs: int
    enforce_eager: bool
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    max_model_len: int | None
    disable_log_stats: bool
    enable_rollout_routing_replay: bool  # MoE: the actor's / reference's forwards use the engine's experts
    record_routed_experts: bool  # MoE: the engine's experts recorded (implied by routing replay)
    multi_turn: MultiTurnConfig  # the agent package's own section type
    val_kwargs: ValKwargs


# ---------------------------------------------------------------------- critic
@dataclass(frozen=True, kw_only=True)
class CriticModelConfig:
    """``critic.model``."""

    path: str
    enable_gradient_checkpointing: bool
    use_remove_padding: bool | str  # "auto" until the worker resolves it (fusedrl.auto_defaults)
    attn_implementation: str
    compile_layers: bool | str
    fsdp_config: FsdpConfig


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """``critic``: the value model (built only for estimators that need one)."""

    model: CriticModelConfig
    optim: OptimConfig
    ppo_mini_batch_size: int
    ppo_micro_batch_size: int | None
    ppo_micro_batch_size_per_gpu: int
    forward_micro_batch_size: int | None
    forward_micro_batch_size_per_gpu: int | None
    ulysses_sequence_parallel_size: int
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    forward_max_token_len_per_gpu: int
    ppo_epochs: int
    cliprange_value: float
    grad_clip: float
    loss_agg_mode: str
    loss_scale_factor: float | None


# ---------------------------------------------------------------------- algorithm
@dataclass(frozen=True, kw_only=True)
class KLControlConfig:
    """``algorithm.kl_ctrl``."""

    type: str
    kl_coef: float
    target_kl: float
    horizon: int


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``."""

    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    bypass_mode: bool
    loss_type: str


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """``algorithm.filter_groups`` (DAPO's dynamic sampling)."""

    enable: bool
    metric: str
    max_num_gen_batches: int


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """``algorithm``: the estimator, KL in reward, rollout correction, dynamic sampling."""

    custom_modules: tuple[str, ...]
    adv_estimator: str
    norm_adv_by_std_in_grpo: bool
    gamma: float
    lam: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig
    gdpo_reward_keys: tuple[str, ...] | None
    gdpo_reward_weights: tuple[float, ...] | None


@dataclass(frozen=True, kw_only=True)
class AsyncTrainingConfig:
    """``async_training``: one-step-off-policy asynchronous training (``trainer/async_trainer.py``) and
    partial rollout in the fused pool (``trainer/partial_trainer.py``)."""

    max_staleness: int
    partial_rollout: bool
    staleness_threshold: float
    partial_rollout_max_resumes: int


# ---------------------------------------------------------------------- reward
@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """``reward_model.overlong_buffer`` (DAPO's soft overlong penalty)."""

    enable: bool
    len: int
    penalty_factor: float
    max_resp_len: int | None


@dataclass(frozen=True, kw_only=True)
class RewardModelPath:
    """``reward_model.model``."""

    path: str | None


@dataclass(frozen=True, kw_only=True)
class RewardModelFsdpConfig:
    """``reward_model.fsdp_config``."""

    model_dtype: str


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """``reward_model``: the reward manager (function scoring) and the optional reward-model role."""

    reward_manager: str
    num_workers: int
    timeout_s: float | None
    on_error: str
    mp_context: str
    reward_kwargs: Mapping[str, Any]
    overlong_buffer: OverlongBufferConfig
    enable: bool
    model: RewardModelPath
    fsdp_config: RewardModelFsdpConfig
    micro_batch_size_per_gpu: int
    ulysses_sequence_parallel_size: int


@dataclass(frozen=True, kw_only=True)
class CustomRewardFunctionConfig:
    """``custom_reward_function``: a user's scoring function file and name."""

    path: str | None
    name: str


# ---------------------------------------------------------------------- data, trainer
@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """``data`` (PPO): prompts and their lengths."""

    train_files: str | tuple[str, ...]
    val_files: str | tuple[str, ...] | None
    prompt_key: str
    train_batch_size: int
    val_batch_size: int | None
    max_prompt_length: int
    max_response_length: int
    filter_overlong_prompts: bool
    truncation: str
    gen_batch_size: int
    return_raw_chat: bool
    image_key: str
    shuffle: bool
    seed: int


@dataclass(frozen=True, kw_only=True)
class PlacementSection:
    """``trainer.placement`` as written (``fusedrl.placement_config`` reads it into pools)."""

    pools: Mapping[str, Any] | None
    roles: Mapping[str, Any] | None
    weight_sync_bucket_mb: float


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """``trainer`` (PPO): the run's size, schedule, checkpoints and guards."""

    project_name: str
    experiment_name: str
    nnodes: int
    n_gpus_per_node: int
    placement: PlacementSection
    total_epochs: int
    total_training_steps: int | None
    balance_batch: bool
    test_freq: int
    val_before_train: bool
    log_val_generations: int
    critic_warmup: int
    logger: tuple[str, ...]
    default_local_dir: str
    save_freq: int
    resume_mode: str
    resume_from_path: str | None
    max_actor_ckpt_to_keep: int | None
    max_consecutive_skipped_steps: int
    rollout_check_tol: float | str | None
    step_timeout_s: float | None
    preemption_save_timeout_s: float | None
    ray_num_cpus: int | None
    ray_init: Mapping[str, Any]
    emulated_bf16: str
    ray_object_store_gb: float


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


@dataclass(frozen=True, kw_only=True)
class RoleConfigs(RunSections):
    """Everything a PPO-family worker's roles read: the run's sections plus the values the driver derives."""

    tokens: TokenIds
    agent_tools: tuple[Any, ...]  # tools passed in Python to the trainer (agentic rollouts)
    total_steps: int | None  # the run's planned steps (`model.compile_layers=auto` reads it); None: unknown

    def needed_roles(self) -> dict[str, bool]:
        """Which optional roles the run builds (``ref``, ``critic``, ``reward_model``: on or off)."""
        import fusedrl.algorithms  # noqa: F401  (registers the built-in estimators)
        from fusedrl.algorithms.registry import roles_for

        use_kl = self.actor.use_kl_loss or self.algorithm.use_kl_in_reward
        return roles_for(self.algorithm.adv_estimator, use_kl=use_kl, reward_model=self.reward_model.enable)

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


def build_role_configs(
    config: Section, *, tokens: TokenIds, agent_tools: Any = (), total_steps: int | None = None
) -> RoleConfigs:
    """The workers' `RoleConfigs` from the resolved PPO config as a plain dict
    (``fusedrl.config.to_plain_dict``), the tokenizer's ids, any Python agent tools and the planned steps
    (the trainer counts them from the data). ``auto`` keys stay ``auto``: each worker resolves them for its
    own device (`fusedrl.auto_defaults`)."""
    arr = config["actor_rollout_ref"]
    sections = {
        name: build_section(cls, arr[name], f"actor_rollout_ref.{name}")
        for name, cls in _ARR_SECTIONS.items()
    }
    sections.update({name: build_section(cls, config[name], name) for name, cls in _PPO_SECTIONS.items()})
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
