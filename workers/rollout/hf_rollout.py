"""Rollout with Hugging Face ``generate`` on the actor's own FSDP2 module (debug / fallback engine).

It shares the actor's parameters, so there is nothing to sync. Every FSDP2 forward is a collective, so
ranks that finish early keep stepping (``synced_gpus``) until all ranks are done.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.batch import RolloutBatch
from fusedrl.workers.logprob import response_log_probs
from fusedrl.workers.rollout.base import EngineContext, SamplingConfig


class HFRollout:
    def __init__(
        self, model: nn.Module, *, max_response_length: int, eos_token_id: int, pad_token_id: int
    ) -> None:
        self.model = model
        self.max_response_length = max_response_length
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        self.model.eval()
        prompt_len = batch.prompts.shape[1]
        position_ids = (batch.prompt_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, Tp]
        kwargs = dict(
            attention_mask=batch.prompt_mask,
            max_new_tokens=sampling.max_tokens,
            do_sample=sampling.do_sample and sampling.temperature > 0,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
        )
        if kwargs["do_sample"]:
            kwargs.update(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0) or None
            )
        del position_ids  # generate derives positions from the attention mask
        # Compiled layers (model.compile_layers) run eager here: every decoding step has a new KV-cache
        # length, which would compile a graph per step.
        # HF samples a batch from one generator: seeded from the rows' seeds, the same rows with the same
        # seeds give the same tokens (resumed runs), though a row's tokens depend on the whole batch.
        seed = None if batch.sample_seeds is None else hash(tuple(batch.sample_seeds.tolist())) % (2**63)
        with torch.random.fork_rng(devices=[]), torch.compiler.set_stance("force_eager"):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(batch.prompts, **kwargs)  # type: ignore[operator]  # [B, Tp + t]
        generated = out[:, prompt_len:]  # [B, t]
        b = batch.num_samples
        responses = torch.full(
            (b, self.max_response_length), self.pad_token_id, dtype=torch.long, device=out.device
        )  # [B, Tr]
        response_mask = torch.zeros_like(responses)  # [B, Tr]
        for i in range(b):
            ids = generated[i].tolist()
            # Keep tokens up to and including the first EOS; generate pads finished rows afterwards.
            n = ids.index(self.eos_token_id) + 1 if self.eos_token_id in ids else len(ids)
            n = min(n, self.max_response_length)
            responses[i, :n] = torch.as_tensor(ids[:n])
            response_mask[i, :n] = 1
        batch.responses = responses
        batch.response_mask = response_mask
        # The engine's "own" log-probs: the same model scores its samples (temperature-scaled), where asked.
        batch.rollout_log_probs = None
        if sampling.log_probs:
            log_probs, _ = response_log_probs(self.model, batch, temperature=max(sampling.temperature, 1e-6))
            batch.rollout_log_probs = log_probs.float() * response_mask
        return batch

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        reset_prefix_cache: bool = True,
        partial: bool = False,
    ) -> None:
        # Same module as the actor: nothing to copy. The fused worker does not even build the stream.
        del named_tensors, reset_prefix_cache, partial

    def param_dtype(self) -> torch.dtype:
        """The dtype of the actor's parameters (its shards; there is no stream to cast)."""
        return next(self.model.parameters()).dtype

    @property
    def weights_discarded(self) -> bool:
        return False  # they are the actor's

    def reset_prefix_cache(self) -> None:
        pass

    def sleep(self, level: int) -> None:
        pass

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        pass


def build(ctx: EngineContext) -> HFRollout:
    """The ``hf`` entry of `fusedrl.workers.rollout.registry`: needs the actor's module (same worker)."""
    if ctx.actor_module is None:
        raise ValueError("rollout.name=hf generates with the actor's module: place both in one worker")
    return HFRollout(
        ctx.actor_module,
        max_response_length=ctx.max_response_length,
        eos_token_id=ctx.eos_token_id,
        pad_token_id=ctx.pad_token_id,
    )
