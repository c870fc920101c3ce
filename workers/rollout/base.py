"""The rollout interface shared by every engine, and the padding that turns samples into a batch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fusedrl.batch import RolloutBatch


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    """Sampling controls of one generate call (train: ``rollout.*``; validation: ``rollout.val_kwargs``)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True


def rollout_dtype(name: str, *, cuda: bool) -> str:
    """The engine dtype for ``rollout.dtype``: ``auto`` is bfloat16 on CUDA (its attention kernels need
    16-bit floats) and float32 on CPU (exact rollout-vs-actor agreement, and CPUs without native bf16
    emulate it slowly); anything else is used as given."""
    if name in ("auto", "None", "null", ""):
        return "bfloat16" if cuda else "float32"
    return name


def log_prob_gap_bound(dtypes: set[str]) -> float | None:
    """The bound on mean |rollout - actor| log-prob that float error alone stays far below, for the dtypes
    the two sides compute in (``float32`` / ``bfloat16``): float32 on both agrees to ~1e-5 (bound 1e-3); bf16
    on either side rounds logits to 8 mantissa bits, measured ~1e-3 to 2e-2 (bound 0.1); None for others."""
    if dtypes == {"float32"}:
        return 1e-3
    if dtypes <= {"float32", "bfloat16"}:
        return 0.1
    return None


class Rollout(Protocol):
    """What the fused worker needs of a rollout engine."""

    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch: ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, reset_prefix_cache: bool = True
    ) -> None: ...

    def param_dtype(self) -> torch.dtype: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...


def unpadded_prompts(batch: RolloutBatch) -> list[list[int]]:
    """Prompt ids without their left padding."""
    return [row[mask.bool()].tolist() for row, mask in zip(batch.prompts, batch.prompt_mask)]


def attach_responses(
    batch: RolloutBatch,
    samples: Sequence[tuple[Sequence[int], Sequence[float]]],
    *,
    max_response_length: int,
    pad_token_id: int,
) -> RolloutBatch:
    """Right-pad ``(token_ids, log_probs)`` samples to ``[B, Tr]`` and set them on ``batch``."""
    b = batch.num_samples
    responses = torch.full((b, max_response_length), pad_token_id, dtype=torch.long)  # [B, Tr]
    response_mask = torch.zeros((b, max_response_length), dtype=torch.long)  # [B, Tr]
    log_probs = torch.zeros((b, max_response_length), dtype=torch.float32)  # [B, Tr]
    for i, (ids, lps) in enumerate(samples):
        n = min(len(ids), max_response_length)
        responses[i, :n] = torch.as_tensor(list(ids[:n]), dtype=torch.long)
        response_mask[i, :n] = 1
        log_probs[i, :n] = torch.as_tensor(list(lps[:n]), dtype=torch.float32)
    batch.responses = responses
    batch.response_mask = response_mask
    batch.rollout_log_probs = log_probs
    return batch
