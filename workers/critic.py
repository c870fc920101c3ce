"""The critic role: a value model (causal-LM backbone + scalar head) under FSDP2 + AdamW, for PPO with GAE.

The value model is Hugging Face's token-classification variant of the policy's architecture with one
label: the decoder stack of the checkpoint plus a freshly initialised ``hidden -> 1`` linear head
(``score``); the LM head of a causal-LM checkpoint is simply not loaded. Training mirrors `ActorRole`:
mini-batch sizes in the config count prompts across all ranks, micro-batches accumulate gradients, and
the loss normaliser of a mini-batch is summed over ranks so the gradient does not depend on the split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.algorithms.value import value_loss
from fusedrl.auto_defaults import require_resolved
from fusedrl.batch import RolloutBatch
from fusedrl.role_config import CriticConfig
from fusedrl.workers.fsdp import (
    build_adamw,
    device_type,
    gathered_for_pass,
    resolve_attn_implementation,
    shard_for_training,
    to_dtype,
)
from fusedrl.workers.layer_compile import has_compiled_layers
from fusedrl.workers.logprob import restore_order, split_micro_batches, token_budget
from fusedrl.workers.optim_step import GuardedStepper, minibatch_updates, set_lr
from fusedrl.workers.packing import pack_batch
from fusedrl.workers.ulysses import check_heads, sp_group, ulysses_response_values

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_value_model(path: str, dtype: str, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """Load ``path`` as a one-label token classifier on CPU in ``dtype`` (``logits``: ``[B, T, 1]``).

    The head's dropout is switched off: the token-classification classes default to 0.1 when the config
    names none, which would make the regression target noisy and ``compute_values`` differ from the
    values seen in training mode.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    config.use_cache = False  # training forwards never use the KV cache
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=to_dtype(dtype), attn_implementation=attn_implementation
    )
    return model


def _broadcast_head(model: nn.Module) -> None:
    """Give every rank rank 0's value head.

    A head missing from the checkpoint is drawn from each rank's RNG, and FSDP2 shards whatever each
    rank holds without checking that the ranks agree. For a ``[1, H]`` head its dim-0 sharding happens
    to keep only rank 0's row, but that is an accident of the shape; the broadcast makes it a rule.
    """
    head = getattr(model, "score", None)
    if head is None or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for p in head.parameters():
            dist.broadcast(p.data, src=0)


class CriticRole:
    """Value model being trained on this rank's shard of every batch.

    ``critic_cfg`` is the ``critic`` config section (verl's keys): ``model.path``,
    ``model.fsdp_config.{model_dtype,param_dtype}``, ``model.enable_gradient_checkpointing``,
    ``optim.{lr,betas,weight_decay}``, ``ppo_mini_batch_size`` (prompts across ranks),
    ``ppo_micro_batch_size_per_gpu``, ``forward_micro_batch_size_per_gpu``, ``ppo_epochs``,
    ``cliprange_value``, ``grad_clip``, ``loss_agg_mode``; ``model.use_remove_padding`` (packed forwards),
    ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu`` / ``forward_max_token_len_per_gpu`` (micro-batches
    by token budget). The process group must already be initialised.
    """

    def __init__(self, critic_cfg: CriticConfig, *, rollout_n: int) -> None:
        self.cfg = critic_cfg
        # Ulysses: a sequence-parallel group's ranks share rows, so the data-parallel size is W / sp.
        self.sp = int(critic_cfg.ulysses_sequence_parallel_size)
        self.sp_group = sp_group(self.sp)
        self.world_size = dist.get_world_size() // self.sp
        self.rollout_n = rollout_n
        model_cfg = critic_cfg.model
        fsdp_cfg = model_cfg.fsdp_config
        require_resolved(
            "critic.model",
            use_remove_padding=model_cfg.use_remove_padding,
            compile_layers=model_cfg.compile_layers,
            param_dtype=fsdp_cfg.param_dtype,
        )
        self.use_remove_padding = bool(model_cfg.use_remove_padding)
        model = load_value_model(
            model_cfg.path,
            fsdp_cfg.model_dtype,
            resolve_attn_implementation(
                model_cfg.attn_implementation, packed=bool(model_cfg.use_remove_padding)
            ),
        )
        model.to(device_type())
        _broadcast_head(model)  # every rank starts from rank 0's randomly initialised head
        self.model = shard_for_training(
            model,
            gradient_checkpointing=bool(model_cfg.enable_gradient_checkpointing),
            param_dtype=fsdp_cfg.param_dtype,
            compile_layers=bool(model_cfg.compile_layers),
        )
        check_heads(self.model, self.sp, "critic.ulysses_sequence_parallel_size")
        self.optimizer = build_adamw(self.model, critic_cfg.optim)
        self.stepper = GuardedStepper(self.model, self.optimizer, float(self.cfg.grad_clip))

    # ------------------------------------------------------------------ forward
    def _forward_values(self, mb: RolloutBatch) -> torch.Tensor:
        """Values of the response positions, ``[b, Tr]`` float32, with whatever grad mode is set."""
        if self.sp_group is not None:  # Ulysses: this rank runs its slice of the packed tokens
            return ulysses_response_values(self.model, mb, self.sp_group, grad_scale=float(self.sp))
        if self.use_remove_padding:
            packed = pack_batch(mb, layout=has_compiled_layers(self.model))
            logits = packed.forward(self.model).logits  # [1, N, 1]
            return packed.unpack(packed.response_rows(logits)[:, 0].float())  # [M] -> [b, Tr]
        input_ids, attention_mask, position_ids = mb.sequences()  # [b, Tp+Tr] each
        prompt_len = mb.prompts.shape[1]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        # Like the log-probs: the value for response token t is read where that token is predicted,
        # i.e. at the hidden state of position t-1, so responses start at Tp-1.
        return out.logits[:, prompt_len - 1 : -1, 0].float()  # [b, Tr]

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """``V(prefix)`` for every response position of this rank's shard: ``[B, Tr]``, 0 on padding."""
        self.model.eval()
        size = self.cfg.forward_micro_batch_size_per_gpu or self.cfg.ppo_micro_batch_size_per_gpu
        budget = token_budget(self.cfg.use_dynamic_bsz, self.cfg.forward_max_token_len_per_gpu)
        mbs, order = split_micro_batches(batch, rows=int(size), max_token_len=budget)
        with gathered_for_pass(self.model):  # one all-gather per layer for the whole pass
            parts = [self._forward_values(mb) for mb in mbs]  # [b_i, Tr] each
        return restore_order(parts, order) * batch.response_mask  # [B, Tr]

    # ------------------------------------------------------------------ training
    def update(self, batch: RolloutBatch, *, lr: float | None = None) -> dict[str, float]:
        """One pass of value regression over this rank's shard (``ppo_epochs`` x mini- x micro-batches).

        Needs ``batch.critic_values`` (the old values, from `compute_values` before the update) and
        ``batch.returns``. Collective: every rank must call it with a shard of the same size.
        """
        if batch.critic_values is None or batch.returns is None:
            raise ValueError("CriticRole.update: the batch needs `critic_values` (old values) and `returns`")
        cfg = self.cfg
        set_lr(self.optimizer, lr)
        self.model.train()
        mini_rows = int(cfg.ppo_mini_batch_size) * self.rollout_n // self.world_size
        if mini_rows < 1:
            raise ValueError(
                f"critic.ppo_mini_batch_size={cfg.ppo_mini_batch_size} x rollout.n={self.rollout_n} gives "
                f"no row per rank with {self.world_size} ranks"
            )
        mode = self.cfg.loss_agg_mode
        clip = float(self.cfg.cliprange_value)

        def micro_loss(mb: RolloutBatch, norms: Mapping[str, float], token_norm: float):
            values = self._forward_values(mb)  # [b, Tr]
            loss, metrics = value_loss(
                values,
                mb.critic_values,
                mb.returns,
                mb.response_mask,
                cliprange_value=clip,
                loss_agg_mode=mode,
                global_norm=norms[mode],
            )
            # The loss already carries the global normaliser; the per-micro-batch means are weighted by
            # this micro-batch's share of the mini-batch's tokens.
            share = mb.response_mask.sum() / max(token_norm, 1e-8)  # []
            return loss, {"vf_loss": loss.detach(), **{k: v * share for k, v in metrics.items()}}

        metrics = minibatch_updates(
            batch,
            stepper=self.stepper,
            micro_loss=micro_loss,
            mini_rows=mini_rows,
            micro_rows=int(cfg.ppo_micro_batch_size_per_gpu),
            epochs=int(self.cfg.ppo_epochs),
            loss_agg_modes=[mode],
            world_size=dist.get_world_size(),  # all ranks: sp replicas count in the normaliser and in FSDP's mean
            loss_scale_factor=cfg.loss_scale_factor,
            max_token_len=token_budget(cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu),
        )
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["critic/skipped_steps"] = float(self.stepper.num_skipped)
        return out
