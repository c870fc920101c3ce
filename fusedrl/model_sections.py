"""The typed sections of the roles that hold a model: ``actor_rollout_ref``'s ``model`` / ``actor`` / ``ref`` /
``rollout`` and ``critic`` (the pieces they share first). Part of `fusedrl.role_config` (which re-exports
every name); each section's own checks sit beside its fields (``problems()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusedrl.agent.runner import MultiTurnConfig


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

    def problems(self) -> list[str]:
        """The model folder exists (or ``path`` is a hub id); the attention implementation is known; the LoRA
        keys (`fusedrl.lora.lora_problems`)."""
        import os

        from fusedrl.config_sections import looks_like_hub_id
        from fusedrl.lora import lora_problems

        found = []
        key = "actor_rollout_ref.model"
        if self.path is not None:  # None: unset (`???`), reported as required
            path = str(self.path)
            if not (os.path.isfile(os.path.join(path, "config.json")) or looks_like_hub_id(path)):
                found.append(
                    f"`{key}.path`: `{path}` is neither a Hugging Face model folder (no config.json) "
                    "nor a hub id (org/name). Point it at a local folder; build a tiny one with "
                    "`python -m fusedrl.utils.tiny_model --out DIR`."
                )
        found.extend(attn_problems(self.attn_implementation, f"{key}.attn_implementation"))
        found.extend(lora_problems(self))
        return found


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

    def problems(self) -> list[str]:
        """Batch sizes, the policy loss, its aggregation and KL kind, the optimizer, the checkpoint contents.
        Losses registered by ``algorithm.custom_modules`` are known once `AlgorithmConfig.problems` ran."""
        from fusedrl.algorithms import list_policy_losses
        from fusedrl.algorithms.kl import KL_KINDS
        from fusedrl.algorithms.losses import LOSS_AGG_MODES
        from fusedrl.config_sections import (
            check_number,
            checkpoint_contents_problems,
            positive,
            schedule_problems,
        )

        key = "actor_rollout_ref.actor"
        found: list[str] = []
        positive(self.ppo_mini_batch_size, f"{key}.ppo_mini_batch_size", found)
        if self.ppo_micro_batch_size is None:  # else derived from it
            positive(self.ppo_micro_batch_size_per_gpu, f"{key}.ppo_micro_batch_size_per_gpu", found)
        positive(self.ulysses_sequence_parallel_size, f"{key}.ulysses_sequence_parallel_size", found)
        mode = self.policy_loss.loss_mode
        if mode not in list_policy_losses():
            found.append(
                f"`{key}.policy_loss.loss_mode`={mode!r}: unknown. Known: {', '.join(list_policy_losses())}."
            )
        if mode in ("clip_cov", "kl_cov"):  # the share of tokens the loss selects
            ratio_key = f"{key}.policy_loss.{mode}_ratio"
            ratio = check_number(getattr(self.policy_loss, f"{mode}_ratio"), ratio_key, found, float)
            if ratio is not None and not 0 < ratio <= 1:
                found.append(f"`{ratio_key}`={ratio}: use (0, 1].")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            found.append(
                f"`{key}.loss_agg_mode`={self.loss_agg_mode!r}: unknown. Known: {', '.join(LOSS_AGG_MODES)}."
            )
        found.extend(loss_scale_problems(self.loss_scale_factor, f"{key}.loss_scale_factor"))
        if self.kl_loss_type not in KL_KINDS:
            found.append(f"`{key}.kl_loss_type`={self.kl_loss_type!r}: use k1, k2, k3 (low_var_kl) or abs.")
        lr = check_number(self.optim.lr, f"{key}.optim.lr", found, float)
        if lr is not None and not lr > 0:
            found.append(f"`{key}.optim.lr`={lr}: must be > 0.")
        checkpoint_contents_problems(self.checkpoint, found)
        schedule_problems(self.optim, f"{key}.optim", found)
        return found


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """``actor_rollout_ref.ref``: the frozen reference's log-prob pass."""

    log_prob_micro_batch_size: int | None
    log_prob_micro_batch_size_per_gpu: int
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    fsdp_config: RefFsdpConfig

    def problems(self) -> list[str]:
        """None of its own: the reference's expert-parallel size is checked against the model's
        (`fusedrl.config_cross_checks`)."""
        return []


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
    calculate_log_probs: bool | str  # "auto": `fusedrl.trainer.step_plan.rollout_log_probs_wanted`
    enable_rollout_routing_replay: bool  # MoE: the actor's / reference's forwards use the engine's experts
    record_routed_experts: bool  # MoE: the engine's experts recorded (implied by routing replay)
    multi_turn: MultiTurnConfig  # the agent package's own section type
    val_kwargs: ValKwargs

    def problems(self) -> list[str]:
        """The engine and what it can do for agent loops, the agent-loop section, the mode, the sleep level,
        the sampling temperature, the engine's package (the tensor-parallel size against the workers and the
        engine: `fusedrl.config_cross_checks`)."""
        import os

        from fusedrl.config_sections import check_number, one_of, positive
        from fusedrl.workers.rollout.registry import (
            EngineTraits,
            engine_spec,
            engines_with,
            requirement_fails,
        )

        key = "actor_rollout_ref.rollout"
        found: list[str] = []
        positive(self.n, f"{key}.n", found)
        try:
            engine = engine_spec(self.name).traits
        except KeyError as err:
            found.append(str(err.args[0]))
            engine = EngineTraits()
        tp = check_number(self.tensor_model_parallel_size, f"{key}.tensor_model_parallel_size", found)
        mt = self.multi_turn
        if mt.enable:
            found.extend(mt.problems())
            if not engine.request_queue:
                found.append(
                    f"`{key}.multi_turn.enable`=true needs an engine that takes requests one at a "
                    f"time, as agent loops queue them (rollout.name={' or '.join(engines_with('request_queue'))}); "
                    f"rollout.name={self.name} generates whole batches only."
                )
            if tp is not None and tp != 1:
                found.append(
                    f"`{key}.multi_turn.enable`=true with tensor_model_parallel_size={tp}: multi-turn "
                    "rollouts run with tensor_model_parallel_size=1 only (every rank of a TP group would have to "
                    "submit the same requests in the same order, tool results included; not implemented). Set "
                    "tensor_model_parallel_size=1 (data-parallel engines, one per worker)."
                )
            path = mt.tool_config_path
            if path and not os.path.isfile(str(path)):
                found.append(f"`{key}.multi_turn.tool_config_path`: file `{path}` does not exist.")
        if self.mode not in ROLLOUT_MODES:
            found.append(
                f"`{key}.mode`={self.mode!r}: use {one_of(ROLLOUT_MODES)} (the in-process engine runs the same way for "
                "both)."
            )
        if self.sleep_level not in SLEEP_LEVELS:
            found.append(
                f"`{key}.sleep_level`={self.sleep_level!r}: use 1 (keep a host copy of the engine's weights "
                "while asleep), 2 (discard them; they are re-streamed before the next rollout) or auto (2 on "
                "CUDA, 1 under LoRA and on CPU)."
            )
        if self.calculate_log_probs not in (True, False, "auto"):
            found.append(
                f"`{key}.calculate_log_probs`={self.calculate_log_probs!r}: use true (the engine's log-probs of "
                "every sample), false (none) or auto (where the step reads them, and on the rollout check's steps)."
            )
        temperature = check_number(self.temperature, f"{key}.temperature", found, float)
        if temperature is not None and not temperature > 0:
            found.append(f"`{key}.temperature`={self.temperature}: must be > 0 for training rollouts.")
        failure = requirement_fails(engine)
        if failure is not None:
            found.append(
                f"`{key}.name`={self.name} but `import {engine.requires}` fails here ({failure}). "
                "Run `make install` or use `rollout.name=hf`."
            )
        return found


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

    def problems(self) -> list[str]:
        """The Ulysses size, the loss scale and the optimizer's schedule (checked whether or not the run
        builds a critic; its attention implementation: `fusedrl.config_cross_checks`, it follows the actor's)."""
        from fusedrl.config_sections import positive, schedule_problems

        found: list[str] = []
        positive(self.ulysses_sequence_parallel_size, "critic.ulysses_sequence_parallel_size", found)
        found.extend(loss_scale_problems(self.loss_scale_factor, "critic.loss_scale_factor"))
        schedule_problems(self.optim, "critic.optim", found)
        return found


def attn_problems(impl: Any, key: str) -> list[str]:
    """A model's ``attn_implementation`` (``key``) is one of `ATTN_IMPLEMENTATIONS`."""
    if impl in ATTN_IMPLEMENTATIONS:
        return []
    return [
        f"`{key}`={impl!r}: use auto (flash_attention_2 when available, else sdpa), sdpa, eager or "
        "flash_attention_2."
    ]


def loss_scale_problems(factor: Any, key: str) -> list[str]:
    """A loss's ``loss_scale_factor`` (``key``): a number > 0, or null (the response width)."""
    from fusedrl.config_sections import check_number

    found: list[str] = []
    if (
        factor is not None
        and (value := check_number(factor, key, found, float)) is not None
        and not value > 0
    ):
        found.append(f"`{key}`={value}: must be > 0 (or null: the response width).")
    return found
