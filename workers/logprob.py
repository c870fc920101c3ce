"""Per-token log-probabilities of responses under a causal LM, computed the way the rollout samples.

The rollout engine samples from ``softmax(logits / temperature)`` and reports that distribution's
log-probs (vLLM's ``processed_logprobs``). The trainer must score with the same distribution, so logits
are divided by the rollout temperature here too; otherwise the PPO ratio and the first-step KL would be
off by the temperature alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fusedrl.algorithms import entropy_from_logits
from fusedrl.batch import RolloutBatch


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    """Consecutive slices of at most ``size`` rows."""
    if size <= 0:
        raise ValueError(f"micro-batch size must be positive, got {size}")
    for start in range(0, batch.num_samples, size):
        yield batch[start : start + size]


def response_log_probs(
    model: nn.Module, batch: RolloutBatch, *, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over prompt+response; returns ``(log_probs [B, Tr], entropy [B, Tr] | None)``.

    Runs with whatever grad mode the caller set: under ``torch.no_grad`` for old/ref log-probs, with
    grad inside the actor update.
    """
    input_ids, attention_mask, position_ids = batch.sequences()  # [B, Tp+Tr] each
    prompt_len = batch.prompts.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    # The token at position t is predicted by the logits at t-1: responses start at Tp.
    logits = logits[:, prompt_len - 1 : -1, :].float() / temperature  # [B, Tr, V]
    log_z = torch.logsumexp(logits, dim=-1)  # [B, Tr]
    token_logits = logits.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)  # [B, Tr]
    log_probs = token_logits - log_z  # [B, Tr]
    entropy = entropy_from_logits(logits) if with_entropy else None  # [B, Tr]
    return log_probs, entropy


@torch.no_grad()
def batched_log_probs(
    model: nn.Module, batch: RolloutBatch, *, temperature: float, micro_batch_size: int
) -> torch.Tensor:
    """No-grad log-probs of the whole batch, ``micro_batch_size`` rows per forward. ``[B, Tr]``."""
    parts = [
        response_log_probs(model, mb, temperature=temperature)[0]
        for mb in micro_batches(batch, micro_batch_size)
    ]
    return torch.cat(parts, dim=0) * batch.response_mask  # [B, Tr], 0 on padding
