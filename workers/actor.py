"""The actor role (policy under FSDP2 + AdamW) and the reference role (a frozen copy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.algorithms import agg_loss, get_policy_loss, kl_penalty
from fusedrl.algorithms.rollout_correction import (
    bypass_correction,
    in_update_correction,
    reinforce_policy_loss,
)
from fusedrl.auto_defaults import require_resolved
from fusedrl.batch import RolloutBatch
from fusedrl.lora import lora_enabled
from fusedrl.models.qwen_vl import is_vision_language_model
from fusedrl.role_config import (
    ActorConfig,
    FsdpConfig,
    ModelConfig,
    RefConfig,
    RefFsdpConfig,
    RolloutCorrectionConfig,
    expert_parallel_size,
)
from fusedrl.workers.fsdp import (
    StreamStats,
    build_adamw,
    build_mesh,
    device_type,
    load_causal_lm,
    resolve_attn_implementation,
    shard_for_training,
    stream_full_tensors,
    to_dtype,
)
from fusedrl.workers.logprob import (
    batched_log_probs,
    batched_log_probs_and_sum_pi_squared,
    response_log_probs,
    restore_order,
    token_budget,
)
from fusedrl.workers.optim_step import GuardedStepper, minibatch_updates, set_lr
from fusedrl.workers.packing import can_share_prompts
from fusedrl.workers.routing_replay import RoutingUse, take_routing_metrics
from fusedrl.workers.ulysses import check_heads, sp_group
from fusedrl.workers.vision import (
    freeze_vision_tower,
    load_vision_language_model,
    shard_vision_language_model,
    vision_batched_log_probs,
    vision_log_probs,
)


def _select(cfg: Any, dotted: str) -> Any:
    """A loss's declared ``config_keys`` entry (dotted under the actor section) from the typed config."""
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def loss_seed_base(rollout_seed: int) -> int:
    """The part of a random loss's seed fixed for the run."""
    return int(rollout_seed) * 1_000_003


def loss_seed(base: int, opt_steps: int, micro_index: int) -> int:
    """The seed of one micro-batch's random loss draw (see `ActorRole._seed_kwargs`)."""
    return (base + opt_steps * 10_007 + micro_index * 101) % (2**63 - 1)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far (AdamW's per-parameter ``step``, saved in checkpoints); 0 before the
    first."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _sharded_model(
    model_cfg: ModelConfig,
    fsdp_cfg: FsdpConfig | RefFsdpConfig,
    *,
    lora: bool = False,
    frozen: bool = False,
    freeze_tower: bool = False,
) -> nn.Module:
    """The role's model, loaded in ``fsdp_cfg.model_dtype`` and FSDP2-sharded with its ``param_dtype``.

    ``frozen`` (the reference): where ``param_dtype`` differs from ``model_dtype``, the weights are cast to
    ``param_dtype`` once here and sharded without mixed precision. A frozen model's master weights are only
    ever read through that cast, so the forwards are the same bit for bit, while every pass skips casting
    the gathered shards and gathers half the bytes (bf16 from float32), and the shards take half the memory.
    """
    require_resolved(
        "actor_rollout_ref",
        use_remove_padding=model_cfg.use_remove_padding,
        compile_layers=model_cfg.compile_layers,
        param_dtype=fsdp_cfg.param_dtype,
    )
    if is_vision_language_model(model_cfg.path):  # Qwen2-VL / Qwen2.5-VL (docs/multimodal.md)
        return _sharded_vision_model(model_cfg, fsdp_cfg, frozen=frozen, freeze_tower=freeze_tower, lora=lora)
    model = load_causal_lm(
        model_cfg.path,
        fsdp_cfg.model_dtype,
        resolve_attn_implementation(model_cfg.attn_implementation, packed=bool(model_cfg.use_remove_padding)),
    )
    if lora:  # PEFT adapters (only they train), then the same FSDP2 wrap as every other model
        from fusedrl.workers.lora import add_lora

        model = add_lora(model, model_cfg)
    param_dtype = fsdp_cfg.param_dtype
    if frozen and param_dtype and to_dtype(param_dtype) != to_dtype(fsdp_cfg.model_dtype):
        for p in model.parameters():  # parameters only, as the mixed precision casts (buffers such as
            p.data = p.data.to(to_dtype(param_dtype))  # the rotary inv_freq stay float32)
        param_dtype = None
    return shard_for_training(
        model,
        gradient_checkpointing=bool(model_cfg.enable_gradient_checkpointing),
        param_dtype=param_dtype,
        compile_layers=bool(model_cfg.compile_layers),
        expert_parallel_size=expert_parallel_size(fsdp_cfg),
    )


def _sharded_vision_model(
    model_cfg: ModelConfig,
    fsdp_cfg: FsdpConfig | RefFsdpConfig,
    *,
    frozen: bool,
    freeze_tower: bool,
    lora: bool = False,
) -> nn.Module:
    """A vision-language policy under FSDP2 (`fusedrl.workers.vision.shard_vision_language_model`: a unit
    per vision block and decoder layer, checkpointed with ``model.enable_gradient_checkpointing``);
    ``freeze_tower``: ``actor.freeze_vision_tower``; ``lora`` (the actor of a LoRA run): PEFT adapters where
    ``model.target_modules`` / ``exclude_modules`` put them (verl's VL script keeps them off the tower), only
    they train. Compiled layers are not built for it."""
    if model_cfg.compile_layers:
        raise ValueError(
            "a vision-language model trains without compile_layers so far; "
            "set actor_rollout_ref.model.compile_layers=false"
        )
    model = load_vision_language_model(model_cfg.path, to_dtype(fsdp_cfg.model_dtype))
    if freeze_tower:
        freeze_vision_tower(model)
    if lora:
        from fusedrl.workers.lora import add_lora

        model = add_lora(model, model_cfg)
    param_dtype = to_dtype(fsdp_cfg.param_dtype) if fsdp_cfg.param_dtype else None
    if frozen and param_dtype is not None and param_dtype != to_dtype(fsdp_cfg.model_dtype):
        model.to(param_dtype)  # the reference: cast once, no mixed precision (as `_sharded_model`)
        param_dtype = None
    checkpointing = bool(model_cfg.enable_gradient_checkpointing)
    return shard_vision_language_model(
        model.to(device_type()), build_mesh(), param_dtype=param_dtype, gradient_checkpointing=checkpointing
    )


class RefRole:
    """Frozen reference policy: same weights as the actor at start, never updated."""

    def __init__(self, model_cfg: ModelConfig, ref_cfg: RefConfig, *, sp: int = 1) -> None:
        """``sp``: the actor's ``ulysses_sequence_parallel_size``; the reference splits sequences the same
        way (the driver gives a group's workers the same rows for both)."""
        self.cfg = ref_cfg
        self.use_remove_padding = bool(model_cfg.use_remove_padding)
        self.sp_group = sp_group(sp)
        self.model = _sharded_model(model_cfg, ref_cfg.fsdp_config, frozen=True)
        self.share_prompts = shares_prompts(model_cfg, self.model)
        check_heads(self.model, sp)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # Routing replay (set by the worker from rollout.enable_rollout_routing_replay): the engine's experts.
        self.routing: RoutingUse | None = None

    def compute_log_prob(self, batch: RolloutBatch, *, temperature: float) -> torch.Tensor:
        """``log pi_ref(response)``: ``[B, Tr]``."""
        if batch.multi_modal_inputs is not None:
            mbs = self.cfg.log_prob_micro_batch_size_per_gpu
            return vision_batched_log_probs(
                self.model,
                batch,
                temperature=temperature,
                micro_batch_size=mbs,
                remove_padding=self.use_remove_padding,
            )
        return batched_log_probs(
            self.model,
            batch,
            temperature=temperature,
            micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
            max_token_len=token_budget(
                self.cfg.log_prob_use_dynamic_bsz, self.cfg.log_prob_max_token_len_per_gpu
            ),
            remove_padding=self.use_remove_padding,
            sp_group=self.sp_group,
            share_prompts=self.share_prompts,
            routing=self.routing,
        )


def shares_prompts(model_cfg: ModelConfig, model: torch.nn.Module) -> bool:
    """Whether this role's packed rows hold a prompt once for the rows that share it: packing and
    ``model.share_prompt_prefix`` on, and fusedrl's CPU attention running every layer."""
    return bool(model_cfg.use_remove_padding and model_cfg.share_prompt_prefix) and can_share_prompts(model)


class ActorRole:
    """The policy being trained: forward/backward under FSDP2, AdamW, grad clipping, micro-batching.

    ``cfg`` is ``actor_rollout_ref.actor`` (`fusedrl.role_config.ActorConfig`). Batches arriving here are this rank's shard; mini-batch sizes
    in the config count prompts across all ranks (as in verl), so they are converted to local rows.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: ActorConfig,
        *,
        rollout_n: int,
        rollout_seed: int = 0,
        rollout_correction: RolloutCorrectionConfig | None = None,
    ) -> None:
        self.cfg = cfg
        # Bypass mode (old log-probs = the rollout's): the rejection and, for loss_type=reinforce, the IS weights
        # are measured in the loss, current policy against rollout (`bypass_correction`); None: nothing to do.
        rc = rollout_correction
        active = (
            rc is not None and rc.bypass_mode and (rc.rollout_rs is not None or rc.loss_type == "reinforce")
        )
        self.bypass = rc if active else None
        # Not bypass, IS weights or rejection on: a batch that comes without old_log_probs (the update's forward
        # gives them) is corrected in the loss (`in_update_correction`); None: nothing to correct there.
        self.correction = None if rc is None or rc.bypass_mode else rc
        # Ulysses: the ranks of one sequence-parallel group share rows, so the data-parallel size is W / sp.
        self.sp_group = sp_group(int(cfg.ulysses_sequence_parallel_size))
        self.world_size = dist.get_world_size() // int(cfg.ulysses_sequence_parallel_size)
        self.rollout_n = rollout_n
        self.use_remove_padding = bool(model_cfg.use_remove_padding)
        self.lora = lora_enabled(model_cfg)  # the model is a PEFT model: only adapters train
        self.model = _sharded_model(
            model_cfg, cfg.fsdp_config, lora=self.lora, freeze_tower=bool(cfg.freeze_vision_tower)
        )
        self.share_prompts = shares_prompts(model_cfg, self.model)
        check_heads(self.model, int(cfg.ulysses_sequence_parallel_size))
        self.optimizer = build_adamw(self.model, cfg.optim)
        self.policy_loss = get_policy_loss(cfg.policy_loss.loss_mode)
        # A loss whose paper fixes the aggregation of its own term (GSPO, GMPO, SAPO) declares it; the entropy
        # and KL terms keep loss_agg_mode (verl's rule).
        self.agg_mode = str(cfg.loss_agg_mode)
        self.pg_agg_mode = str(getattr(self.policy_loss, "agg_mode", cfg.loss_agg_mode))
        # Extra actor keys a loss reads (SAPO's tau_pos / tau_neg, Clip-Cov's policy_loss.clip_cov_*), passed
        # by their last name.
        self.loss_kwargs = {
            key.rsplit(".", 1)[-1]: float(_select(cfg, key))
            for key in getattr(self.policy_loss, "config_keys", ())
        }
        self.loss_seed = loss_seed_base(rollout_seed)
        self._micro_index = 0  # micro-batches since the update began (part of a random loss's seed)
        self.stepper = GuardedStepper(self.model, self.optimizer, float(cfg.grad_clip))
        self._forward_log_probs: list[torch.Tensor] = []  # detached, per micro-batch, during `update`
        # Routing replay / its measurement (set by the worker from the rollout's keys; `routing_replay`): the
        # old-log-prob pass measures the routing mismatch, the update's metrics report it.
        self.routing: RoutingUse | None = None
        self._routing_metrics: dict[str, float] = {}
        self.forward_log_probs: torch.Tensor | None = None  # [B, Tr] after an update without old_log_probs

    # ------------------------------------------------------------------ inference
    def compute_log_prob(
        self,
        batch: RolloutBatch,
        *,
        temperature: float,
        micro_batch_size: int,
        max_token_len: int | None = None,
        with_sum_pi_squared: bool = False,
    ) -> Any:
        """``log pi_old(response)`` before the update: ``[B, Tr]``. ``max_token_len``: dynamic batch size
        (micro-batches by token budget, ``micro_batch_size`` ignored). ``with_sum_pi_squared``: the pair
        ``(log_probs, Σπ²)`` ``[B, Tr]`` each, from the same forwards."""
        self.model.eval()
        if batch.multi_modal_inputs is not None and not with_sum_pi_squared:  # images: workers/vision.py
            mbs = micro_batch_size
            return vision_batched_log_probs(
                self.model,
                batch,
                temperature=temperature,
                micro_batch_size=mbs,
                remove_padding=self.use_remove_padding,
            )
        take_routing_metrics()
        lp, spp = batched_log_probs_and_sum_pi_squared(
            self.model,
            batch,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            max_token_len=max_token_len,
            remove_padding=self.use_remove_padding,
            with_sum_pi_squared=with_sum_pi_squared,
            sp_group=self.sp_group,
            share_prompts=self.share_prompts,
            routing=self.routing,
        )
        self._routing_metrics = take_routing_metrics()  # reported with the next update's metrics
        return (lp, spp) if with_sum_pi_squared else lp

    # ------------------------------------------------------------------ training
    def _loss_terms(
        self, mb: RolloutBatch, *, temperature: float, norms: Mapping[str, float], token_norm: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        mode = self.agg_mode
        norm = norms[mode]
        entropy_coeff = float(cfg.entropy_coeff)
        if (
            mb.multi_modal_inputs is not None
        ):  # images ride with the rows: the M-RoPE pass (workers/vision.py)
            log_prob, entropy = vision_log_probs(
                self.model,
                mb,
                temperature=temperature,
                with_entropy=True,
                remove_padding=self.use_remove_padding,
            )
        else:
            log_prob, entropy = response_log_probs(
                self.model,
                mb,
                temperature=temperature,
                with_entropy=True,
                remove_padding=self.use_remove_padding,
                sp_group=self.sp_group,
                share_prompts=self.share_prompts,
                routing=self.routing,
            )  # [b, Tr]
        old_log_prob = mb.old_log_probs  # [b, Tr]
        if old_log_prob is None:
            # The batch is used once, in one mini-batch: the policy before the step is this very forward.
            old_log_prob = log_prob.detach()
            self._forward_log_probs.append(old_log_prob)
        advantages, corr_metrics = in_update_correction(self.correction, mb, old_log_prob)  # [b, Tr]
        pg_mask = mb.response_mask  # [b, Tr]
        weights = None
        if self.bypass is not None:
            rc = self.bypass
            pg_mask, weights = bypass_correction(
                log_prob,
                old_log_prob,
                mb.response_mask,
                rollout_is=rc.rollout_is,
                rollout_is_threshold=float(rc.rollout_is_threshold),
                rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize),
                rollout_rs=rc.rollout_rs,
                rollout_rs_threshold=rc.rollout_rs_threshold,
                loss_type=rc.loss_type,
            )  # [b, Tr] each
        if self.bypass is not None and self.bypass.loss_type == "reinforce":
            pg_loss, pg_metrics = reinforce_policy_loss(
                log_prob,
                old_log_prob,
                advantages,
                pg_mask,
                weights=weights,
                loss_agg_mode=self.pg_agg_mode,
                global_norm=norms[self.pg_agg_mode],
            )
        else:
            pg_loss, pg_metrics = self._policy_term(log_prob, old_log_prob, advantages, pg_mask, norms)
        pg_metrics.update(corr_metrics)  # rollout_corr/*: means over this micro-batch's valid tokens
        if self.bypass is not None and self.bypass.rollout_rs is not None:
            # share of this micro-batch's valid tokens the in-loss rejection dropped (token-weighted below)
            valid = mb.response_mask.sum().clamp(min=1)
            pg_metrics["rollout_rs_rejected_frac"] = ((mb.response_mask - pg_mask).sum() / valid).detach()
        assert entropy is not None
        loss = pg_loss  # []
        if entropy_coeff != 0:  # at 0 (verl's default) the backward never walks the entropy's graph
            loss = loss - entropy_coeff * agg_loss(entropy, mb.response_mask, mode, norm)
        # The reported entropy is the token mean whatever the loss aggregation (comparable across modes).
        token_share = mb.response_mask.sum() / max(token_norm, 1e-8)
        entropy_mean = (entropy * mb.response_mask).sum() / mb.response_mask.sum().clamp(min=1)
        terms = {"pg_loss": pg_loss.detach(), "entropy": (entropy_mean * token_share).detach()}
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, mb.ref_log_probs, cfg.kl_loss_type)  # [b, Tr]
            kl_loss = agg_loss(kl, mb.response_mask, mode, norm)  # []
            loss = loss + float(cfg.kl_loss_coef) * kl_loss
            terms["kl_loss"] = kl_loss.detach()
        # Ratio diagnostics are per micro-batch means; weight them by this micro-batch's share.
        share = mb.response_mask.sum() / max(token_norm, 1e-8)
        for key, value in pg_metrics.items():
            terms[key] = value.detach() * share
        return loss, terms

    def _policy_term(
        self,
        log_prob: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        norms: Mapping[str, float],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured policy loss on one micro-batch, normalised by its own aggregation mode's norm."""
        cfg = self.cfg
        clip = float(cfg.clip_ratio)
        return self.policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            mask,
            clip_ratio_low=float(clip if cfg.clip_ratio_low is None else cfg.clip_ratio_low),
            clip_ratio_high=float(clip if cfg.clip_ratio_high is None else cfg.clip_ratio_high),
            clip_ratio_c=float(cfg.clip_ratio_c),
            loss_agg_mode=self.pg_agg_mode,
            global_norm=norms[self.pg_agg_mode],
            **self.loss_kwargs,
            **self._seed_kwargs(),
        )

    def update(self, batch: RolloutBatch, *, temperature: float, lr: float | None = None) -> dict[str, float]:
        """One PPO update pass over this rank's shard (``ppo_epochs`` x mini-batches x micro-batches).
        ``lr``: this step's learning rate (the driver's schedule); None keeps the current one.

        A batch without ``old_log_probs`` must be used once in a single mini-batch (one optimizer step):
        the old log-probs are then the update's own forward, detached (the same values a separate pass
        would compute before the step), and `forward_log_probs` holds them afterwards (``[B, Tr]``).
        """
        cfg = self.cfg
        mini_rows = cfg.ppo_mini_batch_size * self.rollout_n // self.world_size
        epochs = int(cfg.ppo_epochs)
        from_forward = batch.old_log_probs is None
        if from_forward and (epochs != 1 or batch.num_samples > mini_rows):
            raise ValueError(
                f"actor update without old_log_probs: needs ppo_epochs=1 and one mini-batch, got ppo_epochs="
                f"{epochs} and {batch.num_samples} rows > {mini_rows} per mini-batch; compute them first"
            )
        set_lr(self.optimizer, lr)
        self._micro_index = 0
        take_routing_metrics()
        self.model.train()
        self._forward_log_probs = []
        orders: list[torch.Tensor] = []
        metrics = minibatch_updates(
            batch,
            stepper=self.stepper,
            micro_loss=lambda mb, norms, token_norm: self._loss_terms(
                mb, temperature=temperature, norms=norms, token_norm=token_norm
            ),
            mini_rows=mini_rows,
            micro_rows=cfg.ppo_micro_batch_size_per_gpu,
            epochs=epochs,
            loss_agg_modes=[self.pg_agg_mode, self.agg_mode],
            world_size=dist.get_world_size(),  # all ranks: sp replicas count in the normaliser and in FSDP's mean
            loss_scale_factor=cfg.loss_scale_factor,
            max_token_len=token_budget(cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu),
            on_micro_split=orders.append,
            share_prompts=self.share_prompts,
        )
        self.forward_log_probs = (
            restore_order(self._forward_log_probs, orders[0]) * batch.response_mask if from_forward else None
        )  # [B, Tr], 0 on padding
        self._forward_log_probs = []
        out = {k if k.startswith("rollout_corr/") else f"actor/{k}": v for k, v in metrics.items()}
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/skipped_steps"] = float(self.stepper.num_skipped)
        out["actor/consecutive_skipped_steps"] = float(self.stepper.consecutive_skipped)
        # The routing mismatch of the old-log-prob pass, else of this update's forwards (old log-probs from
        # the update: one mini-batch, every forward before the step)
        routing_metrics = self._routing_metrics if batch.old_log_probs is not None else {}
        out.update(routing_metrics or take_routing_metrics())
        self._routing_metrics = {}
        return out

    def _seed_kwargs(self) -> dict[str, int]:
        """``seed`` for a loss that draws at random (``needs_seed``, Clip-Cov): a function of the rollout
        seed, the optimizer's step count (checkpointed, so a resumed run continues it) and the
        micro-batch's place in this update."""
        if not getattr(self.policy_loss, "needs_seed", False):
            return {}
        self._micro_index += 1
        return {"seed": loss_seed(self.loss_seed, optimizer_steps(self.optimizer), self._micro_index)}

    # ------------------------------------------------------------------ weights
    def stream_weights(
        self, stats: StreamStats | None = None, *, full: bool = True, dtype: torch.dtype | None = None
    ):
        """Full tensors of the current policy, one at a time (collective: all ranks iterate together),
        named as in the base model. Under LoRA the adapted modules come merged, and ``full=False`` yields
        only them (with their fused siblings: `fusedrl.workers.lora.merged_lora_stream`). ``dtype``: the
        receiver's parameter dtype (shards are cast before they are gathered)."""
        if self.lora:
            from fusedrl.workers.lora import merged_lora_stream

            return merged_lora_stream(self.model, full=full, stats=stats, dtype=dtype)
        return stream_full_tensors(self.model, stats, dtype)
