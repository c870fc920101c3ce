"""The SFT worker: one process per device slot training a causal LM under FSDP2 on its data shard.

A plain class; the worker group wraps it with ``ray.remote``. Two-phase construction like the fused RL
worker: ``__init__`` records who it is, `init` joins torch.distributed (gloo on CPU, NCCL on GPU) and builds
the sharded model and optimizer, collectively on every rank.

Loss. A step's loss is the mean negative log-likelihood over every loss token of the *whole* step (all
ranks, all micro-batches), so the gradient does not depend on how rows were split across ranks or
micro-batches. Each micro-batch backpropagates ``sum(nll over its loss tokens) / (N_global / W)``: FSDP
averages gradients over the ``W`` ranks, which turns that into ``sum(all nll) / N_global``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusedrl.checkpoint import ACTOR_DIR, shard_prefix
from fusedrl.lr_schedule import SCHEDULERS
from fusedrl.sft_role_config import SFTRoleConfigs
from fusedrl.workers.checkpoint_io import load_fsdp_state, save_fsdp_state
from fusedrl.workers.distributed import DistributedWorker
from fusedrl.workers.export import export_hf
from fusedrl.workers.fsdp import (
    build_adamw,
    device_type,
    gathered_for_pass,
    load_causal_lm,
    shard_for_training,
)
from fusedrl.workers.logprob import micro_batches
from fusedrl.workers.optim_step import clip_grad_norm, defer_grad_sync, grad_sync

Batch = dict[str, torch.Tensor]
LR_SCHEDULERS = SCHEDULERS  # `fusedrl.lr_schedule` is their home


def lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int,
    scheduler: str,
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Linear warmup over the first ``warmup_steps`` steps (step ``s`` uses ``(s + 1) / warmup_steps`` of the
    base rate, so the first step already moves), then ``constant`` or a half-cosine from the base rate
    down to ``min_lr_ratio`` x base at ``total_steps``.
    """
    if scheduler not in LR_SCHEDULERS:
        raise ValueError(f"unknown lr scheduler {scheduler!r}; use one of {LR_SCHEDULERS}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if scheduler == "constant":
        return base_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def masked_nll(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of next-token NLL over loss tokens, number of loss tokens)`` of a right-padded batch.

    Token ``t`` is predicted by the logits at ``t - 1``; ``loss_mask[:, t]`` says whether it counts.
    """
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits  # [b, T, V]
    logits = logits[:, :-1, :].float()  # [b, T-1, V]
    targets = batch["input_ids"][:, 1:]  # [b, T-1]
    mask = batch["loss_mask"][:, 1:].to(logits.dtype)  # [b, T-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (nll.view_as(mask) * mask).sum(), mask.sum()


def trimmed_micro_batches(batch: Batch, size: int) -> Iterator[Batch]:
    """Consecutive slices of at most ``size`` rows (`micro_batches`), each cut to its longest row (right
    padding)."""
    for mb in micro_batches(batch, size):
        length = max(2, int(mb["attention_mask"].sum(dim=1).max()))
        yield {k: v[:, :length] for k, v in mb.items()}


class SFTWorker(DistributedWorker):
    """One data-parallel rank of supervised fine-tuning. ``config`` is the typed SFT config the driver
    built (`fusedrl.sft_role_config.SFTRoleConfigs`, with ``total_steps``: the run's optimizer steps, which the
    LR schedule spans)."""

    config: SFTRoleConfigs

    def __init__(self, config: SFTRoleConfigs, *, rank: int, world_size: int) -> None:
        super().__init__(config, rank=rank, world_size=world_size)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.num_steps = 0  # optimizer steps taken (drives the LR schedule; checkpointed)
        self.num_skipped_steps = 0  # steps dropped for a non-finite gradient norm
        self.device = torch.device(device_type())

    # ------------------------------------------------------------------ setup
    def init(self, master_addr: str, master_port: int) -> dict[str, float]:
        """Join the process group and build the FSDP2 model and AdamW. Collective."""
        t0 = time.perf_counter()
        self._join(master_addr, master_port)
        self._resolve_auto_defaults()  # model.fsdp_config.param_dtype=auto for this device
        if device_type() == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(int(self.config.trainer.seed))

        model_cfg = self.config.model
        fsdp_cfg = model_cfg.fsdp_config
        model = load_causal_lm(model_cfg.path, fsdp_cfg.model_dtype)
        self.model = shard_for_training(
            model,
            gradient_checkpointing=bool(model_cfg.enable_gradient_checkpointing),
            param_dtype=fsdp_cfg.param_dtype,
        )
        self.optimizer = build_adamw(self.model, self.config.optim, lr=self.current_lr())
        return {"timing_s/init": time.perf_counter() - t0}

    def current_lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        optim = self.config.optim
        total = int(self.config.total_steps) or 1
        return lr_at(
            self.num_steps,
            base_lr=float(optim.lr),
            total_steps=total,
            warmup_steps=int(float(optim.warmup_steps_ratio) * total),
            scheduler=str(optim.lr_scheduler),
            min_lr_ratio=float(optim.min_lr_ratio),
        )

    def _parts(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.model is None or self.optimizer is None:
            raise RuntimeError("SFTWorker: call init() first")
        return self.model, self.optimizer

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [float(v) for v in t.tolist()]

    # ------------------------------------------------------------------ training
    def train_step(self, batch_shard: Batch, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on this rank's shard: accumulate over micro-batches, clip, step. Collective.

        Every rank must get a shard with the same number of rows (see `fusedrl.data.sft_dataset.shard_batch`),
        so all ranks run the same number of forward/backward passes.
        """
        model, optimizer = self._parts()
        t0 = time.perf_counter()
        model.train()
        batch = self._to_device(batch_shard)
        local_tokens = float(batch["loss_mask"][:, 1:].sum())
        (global_tokens,) = self._all_reduce_sum([local_tokens])
        # FSDP averages gradients over ranks; dividing by N/W makes the result sum(nll) / N.
        denom = max(global_tokens, 1.0) / self.world_size
        optimizer.zero_grad(set_to_none=True)
        nll_total = torch.zeros((), dtype=torch.float64, device=self.device)
        mbs = list(trimmed_micro_batches(batch, int(micro_batch_size)))
        defer = defer_grad_sync(model, self.world_size)
        with gathered_for_pass(
            model
        ):  # layers gathered once for all micro-batches; resharded before the step
            for i, mb in enumerate(mbs):
                nll_sum, _ = masked_nll(model, mb)
                with grad_sync(model, last=i == len(mbs) - 1, defer=defer):
                    (nll_sum / denom).backward()
                nll_total += nll_sum.detach().double()
        lr = self.current_lr()
        for group in optimizer.param_groups:
            group["lr"] = lr
        norm = float(clip_grad_norm(model.parameters(), float(self.config.optim.clip_grad)))
        if math.isfinite(norm):
            optimizer.step()
        else:
            self.num_skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        (nll_global,) = self._all_reduce_sum([float(nll_total)])
        return {
            "train/loss": nll_global / max(global_tokens, 1.0),
            "train/lr": lr,
            "train/grad_norm": norm,
            "train/loss_tokens": global_tokens,
            "train/skipped_steps": float(self.num_skipped_steps),
            "timing_s/train_step_inner": time.perf_counter() - t0,
        }

    @torch.no_grad()
    def eval_loss(self, batch_shard: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """Token-mean NLL of the whole (all ranks') batch, plus its sums to pool batches. Collective."""
        model, _ = self._parts()
        model.eval()
        size = int(micro_batch_size or self.config.data.micro_batch_size_per_gpu)
        batch = self._to_device(batch_shard)
        nll = 0.0
        tokens = 0.0
        for mb in trimmed_micro_batches(batch, size):
            s, n = masked_nll(model, mb)
            nll += float(s)
            tokens += float(n)
        nll, tokens = self._all_reduce_sum([nll, tokens])
        return {"loss": nll / max(tokens, 1.0), "nll_sum": nll, "num_tokens": tokens}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str) -> dict[str, float]:
        """This rank's model/optimizer shards, RNG and step counters. No collectives."""
        model, optimizer = self._parts()
        info = save_fsdp_state(
            model,
            optimizer,
            shard_prefix(ckpt_dir, self.rank, ACTOR_DIR),
            extra={"num_steps": self.num_steps, "num_skipped_steps": self.num_skipped_steps},
        )
        return {"checkpoint/shard_mb": info["bytes"] / 1e6}

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, float]:
        """Restore what `save_checkpoint` wrote (same world size). No collectives."""
        model, optimizer = self._parts()
        extra = load_fsdp_state(model, optimizer, shard_prefix(ckpt_dir, self.rank, ACTOR_DIR))
        self.num_steps = int(extra.get("num_steps", 0))
        self.num_skipped_steps = int(extra.get("num_skipped_steps", 0))
        return {}

    def export_hf(self, out_dir: str) -> list[str]:
        """Write the model as a Hugging Face folder (rank 0 writes; returns its files). Collective."""
        model, _ = self._parts()
        return export_hf(model, out_dir, src_model_dir=self.config.model.path, rank=self.rank)
