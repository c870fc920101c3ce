"""The actor role (policy under FSDP2 + AdamW) and the reference role (a frozen copy)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.algorithms import agg_loss, get_policy_loss, kl_penalty
from fusedrl.batch import RolloutBatch
from fusedrl.workers.fsdp import (
    StreamStats,
    build_adamw,
    load_causal_lm,
    resolve_attn_implementation,
    shard_for_training,
    stream_full_tensors,
)
from fusedrl.workers.logprob import batched_log_probs, response_log_probs, token_budget
from fusedrl.workers.optim_step import GuardedStepper, minibatch_updates


def _sharded_model(model_cfg: dict[str, Any], fsdp_cfg: dict[str, Any]) -> nn.Module:
    model = load_causal_lm(
        model_cfg["path"],
        fsdp_cfg.get("model_dtype", "float32"),
        resolve_attn_implementation(model_cfg.get("attn_implementation")),
    )
    return shard_for_training(model, model_cfg, fsdp_cfg)


class RefRole:
    """Frozen reference policy: same weights as the actor at start, never updated."""

    def __init__(self, model_cfg: dict[str, Any], ref_cfg: dict[str, Any]) -> None:
        self.cfg = ref_cfg
        self.use_remove_padding = bool(model_cfg.get("use_remove_padding", False))
        self.model = _sharded_model(model_cfg, ref_cfg.get("fsdp_config", {}))
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def compute_log_prob(self, batch: RolloutBatch, *, temperature: float) -> torch.Tensor:
        """``log pi_ref(response)``: ``[B, Tr]``."""
        return batched_log_probs(
            self.model,
            batch,
            temperature=temperature,
            micro_batch_size=self.cfg["log_prob_micro_batch_size_per_gpu"],
            max_token_len=token_budget(
                self.cfg, "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"
            ),
            remove_padding=self.use_remove_padding,
        )


class ActorRole:
    """The policy being trained: forward/backward under FSDP2, AdamW, grad clipping, micro-batching.

    ``cfg`` is ``actor_rollout_ref.actor``. Batches arriving here are this rank's shard; mini-batch sizes
    in the config count prompts across all ranks (as in verl), so they are converted to local rows.
    """

    def __init__(self, model_cfg: dict[str, Any], cfg: dict[str, Any], *, rollout_n: int) -> None:
        self.cfg = cfg
        self.world_size = dist.get_world_size()
        self.rollout_n = rollout_n
        self.use_remove_padding = bool(model_cfg.get("use_remove_padding", False))
        self.model = _sharded_model(model_cfg, cfg.get("fsdp_config", {}))
        self.optimizer = build_adamw(self.model, cfg["optim"])
        self.policy_loss = get_policy_loss(cfg.get("policy_loss", {}).get("loss_mode", "vanilla"))
        self.stepper = GuardedStepper(self.model, self.optimizer, float(cfg.get("grad_clip", 1.0)))

    # ------------------------------------------------------------------ inference
    def compute_log_prob(
        self,
        batch: RolloutBatch,
        *,
        temperature: float,
        micro_batch_size: int,
        max_token_len: int | None = None,
    ) -> torch.Tensor:
        """``log pi_old(response)`` before the update: ``[B, Tr]``. ``max_token_len``: dynamic batch size
        (micro-batches by token budget, ``micro_batch_size`` ignored)."""
        self.model.eval()
        return batched_log_probs(
            self.model,
            batch,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            max_token_len=max_token_len,
            remove_padding=self.use_remove_padding,
        )

    # ------------------------------------------------------------------ training
    def _loss_terms(
        self, mb: RolloutBatch, *, temperature: float, norm: float, token_norm: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        mode = cfg.get("loss_agg_mode", "token-mean")
        entropy_coeff = float(cfg.get("entropy_coeff", 0.0))
        log_prob, entropy = response_log_probs(
            self.model, mb, temperature=temperature, with_entropy=True, remove_padding=self.use_remove_padding
        )  # [b, Tr]
        clip = float(cfg.get("clip_ratio", 0.2))
        pg_loss, pg_metrics = self.policy_loss(
            log_prob,
            mb.old_log_probs,
            mb.advantages,
            mb.response_mask,
            clip_ratio_low=float(clip if cfg.get("clip_ratio_low") is None else cfg["clip_ratio_low"]),
            clip_ratio_high=float(clip if cfg.get("clip_ratio_high") is None else cfg["clip_ratio_high"]),
            clip_ratio_c=float(cfg.get("clip_ratio_c", 3.0)),
            loss_agg_mode=mode,
            global_norm=norm,
        )
        assert entropy is not None
        entropy_loss = agg_loss(entropy, mb.response_mask, mode, norm)  # []
        loss = pg_loss - entropy_coeff * entropy_loss  # []
        # The reported entropy is the token mean whatever the loss aggregation (comparable across modes).
        token_share = mb.response_mask.sum() / max(token_norm, 1e-8)
        entropy_mean = (entropy * mb.response_mask).sum() / mb.response_mask.sum().clamp(min=1)
        terms = {"pg_loss": pg_loss.detach(), "entropy": (entropy_mean * token_share).detach()}
        if cfg.get("use_kl_loss", False):
            kl = kl_penalty(log_prob, mb.ref_log_probs, cfg.get("kl_loss_type", "low_var_kl"))  # [b, Tr]
            kl_loss = agg_loss(kl, mb.response_mask, mode, norm)  # []
            loss = loss + float(cfg.get("kl_loss_coef", 0.001)) * kl_loss
            terms["kl_loss"] = kl_loss.detach()
        # Ratio diagnostics are per micro-batch means; weight them by this micro-batch's share.
        share = mb.response_mask.sum() / max(token_norm, 1e-8)
        for key, value in pg_metrics.items():
            terms[key] = value.detach() * share
        return loss, terms

    def update(self, batch: RolloutBatch, *, temperature: float) -> dict[str, float]:
        """One PPO update pass over this rank's shard (``ppo_epochs`` x mini-batches x micro-batches)."""
        cfg = self.cfg
        self.model.train()
        metrics = minibatch_updates(
            batch,
            stepper=self.stepper,
            micro_loss=lambda mb, norm, token_norm: self._loss_terms(
                mb, temperature=temperature, norm=norm, token_norm=token_norm
            ),
            mini_rows=cfg["ppo_mini_batch_size"] * self.rollout_n // self.world_size,
            micro_rows=cfg["ppo_micro_batch_size_per_gpu"],
            epochs=int(cfg.get("ppo_epochs", 1)),
            loss_agg_mode=cfg.get("loss_agg_mode", "token-mean"),
            world_size=self.world_size,
            max_token_len=token_budget(cfg, "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        )
        out = {f"actor/{k}": v for k, v in metrics.items()}
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/skipped_steps"] = float(self.stepper.num_skipped)
        out["actor/consecutive_skipped_steps"] = float(self.stepper.consecutive_skipped)
        return out

    # ------------------------------------------------------------------ weights
    def stream_weights(self, stats: StreamStats | None = None):
        """Full tensors of the current policy, one at a time (collective: all ranks iterate together)."""
        return stream_full_tensors(self.model, stats)
