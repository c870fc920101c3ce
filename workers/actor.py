"""The actor role (policy under FSDP2 + AdamW) and the reference role (a frozen copy)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.algorithms import agg_denominator, agg_loss, get_policy_loss, kl_penalty
from fusedrl.batch import RolloutBatch
from fusedrl.workers.fsdp import (
    StreamStats,
    apply_fsdp2,
    build_mesh,
    device_type,
    load_causal_lm,
    stream_full_tensors,
    to_dtype,
)
from fusedrl.workers.logprob import batched_log_probs, micro_batches, response_log_probs


def _sharded_model(model_cfg: dict[str, Any], fsdp_cfg: dict[str, Any]) -> nn.Module:
    model = load_causal_lm(model_cfg["path"], fsdp_cfg.get("model_dtype", "float32"))
    if model_cfg.get("enable_gradient_checkpointing", False):
        model.gradient_checkpointing_enable()
    param_dtype = fsdp_cfg.get("param_dtype")
    model.to(device_type())
    return apply_fsdp2(model, build_mesh(), param_dtype=to_dtype(param_dtype) if param_dtype else None)


class RefRole:
    """Frozen reference policy: same weights as the actor at start, never updated."""

    def __init__(self, model_cfg: dict[str, Any], ref_cfg: dict[str, Any]) -> None:
        self.cfg = ref_cfg
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
        self.model = _sharded_model(model_cfg, cfg.get("fsdp_config", {}))
        optim = cfg["optim"]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim["lr"],
            betas=tuple(optim.get("betas", (0.9, 0.999))),
            weight_decay=optim.get("weight_decay", 0.0),
        )
        self.policy_loss = get_policy_loss(cfg.get("policy_loss", {}).get("loss_mode", "vanilla"))
        self.num_skipped_steps = 0
        self.consecutive_skipped_steps = 0

    # ------------------------------------------------------------------ inference
    def compute_log_prob(
        self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int
    ) -> torch.Tensor:
        """``log pi_old(response)`` before the update: ``[B, Tr]``."""
        self.model.eval()
        return batched_log_probs(
            self.model, batch, temperature=temperature, micro_batch_size=micro_batch_size
        )

    # ------------------------------------------------------------------ training
    def _loss_terms(
        self, mb: RolloutBatch, *, temperature: float, norm: float, token_norm: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        mode = cfg.get("loss_agg_mode", "token-mean")
        entropy_coeff = float(cfg.get("entropy_coeff", 0.0))
        log_prob, entropy = response_log_probs(
            self.model, mb, temperature=temperature, with_entropy=True
        )  # [b, Tr]
        clip = float(cfg.get("clip_ratio", 0.2))
        pg_loss, pg_metrics = self.policy_loss(
            log_prob,
            mb.old_log_probs,
            mb.advantages,
            mb.response_mask,
            clip_ratio_low=float(cfg.get("clip_ratio_low") or clip),
            clip_ratio_high=float(cfg.get("clip_ratio_high") or clip),
            clip_ratio_c=float(cfg.get("clip_ratio_c", 3.0)),
            loss_agg_mode=mode,
            global_norm=norm,
        )
        assert entropy is not None
        entropy_loss = agg_loss(entropy, mb.response_mask, mode, norm)  # []
        loss = pg_loss - entropy_coeff * entropy_loss  # []
        terms = {"pg_loss": pg_loss.detach(), "entropy": entropy_loss.detach()}
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
        mini_rows = cfg["ppo_mini_batch_size"] * self.rollout_n // self.world_size
        micro_rows = cfg["ppo_micro_batch_size_per_gpu"]
        mode = cfg.get("loss_agg_mode", "token-mean")
        sums: dict[str, float] = {}
        n_mini = 0
        for _ in range(int(cfg.get("ppo_epochs", 1))):
            for mini in micro_batches(batch, mini_rows):
                # Normaliser of the whole mini-batch across ranks and micro-batches, so the gradient does
                # not depend on how the batch was split. FSDP averages gradients over ranks, hence / W.
                local = torch.tensor(
                    [agg_denominator(mini.response_mask, mode), float(mini.response_mask.sum())],
                    dtype=torch.float64,
                )
                dist.all_reduce(local)
                norm, token_norm = (v / self.world_size for v in local.tolist())
                self.optimizer.zero_grad(set_to_none=True)
                mini_terms: dict[str, torch.Tensor] = {}
                for mb in micro_batches(mini, micro_rows):
                    loss, terms = self._loss_terms(
                        mb, temperature=temperature, norm=norm, token_norm=token_norm
                    )
                    loss.backward()
                    for key, value in terms.items():
                        mini_terms[key] = mini_terms.get(key, 0.0) + value
                grad_norm = self._clip_and_step()
                # Each rank holds 1/W of every mini-batch quantity (normalised by W * norm): sum them.
                keys = sorted(mini_terms)
                packed = torch.stack([mini_terms[k].float() for k in keys]) / self.world_size
                dist.all_reduce(packed)
                for key, value in zip(keys, packed.tolist()):
                    sums[key] = sums.get(key, 0.0) + value
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm
                n_mini += 1
        metrics = {f"actor/{k}": v / max(n_mini, 1) for k, v in sums.items()}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["actor/skipped_steps"] = float(self.num_skipped_steps)
        metrics["actor/consecutive_skipped_steps"] = float(self.consecutive_skipped_steps)
        return metrics

    def _clip_and_step(self) -> float:
        """Clip the global grad norm and step; a non-finite norm skips the step (counted)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), float(self.cfg.get("grad_clip", 1.0))
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        value = float(grad_norm)
        if math.isfinite(value):
            self.optimizer.step()
            self.consecutive_skipped_steps = 0
        else:
            self.num_skipped_steps += 1
            self.consecutive_skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        return value

    # ------------------------------------------------------------------ weights
    def stream_weights(self, stats: StreamStats | None = None):
        """Full tensors of the current policy, one at a time (collective: all ranks iterate together)."""
        return stream_full_tensors(self.model, stats)
