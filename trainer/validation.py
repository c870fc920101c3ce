"""What the PPO trainer reports from a validation pass: mean score overall and per data source, and
``trainer.log_val_generations`` samples printed (the first ones in file order, so runs and steps show the
same prompts)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.metrics import Metrics


def validation_metrics(batch: RolloutBatch, per_sample: torch.Tensor) -> Metrics:
    """``val/test_score/mean`` and ``val/test_score/<data_source>`` of the ``[B]`` sequence scores."""
    out: Metrics = {"val/test_score/mean": float(per_sample.mean())}
    sources = np.array(batch.field_list("data_source"))
    for source in sorted(set(sources.tolist())):
        out[f"val/test_score/{source}"] = float(per_sample[torch.as_tensor(sources == source)].mean())
    return out


def print_generations(
    tokenizer: Any, batch: RolloutBatch, scores: torch.Tensor, count: int, step: int
) -> None:
    """Print the first ``count`` samples of ``batch``: score, prompt and response (sampled tokens only)."""
    for i in range(min(count, batch.num_samples)):
        prompt = tokenizer.decode(batch.prompts[i][batch.prompt_mask[i].bool()])
        response = tokenizer.decode(batch.responses[i][batch.response_mask[i].bool()])
        print(
            f"[val step {step} sample {i}] score={float(scores[i]):.3f}\n[prompt] {prompt}\n[response] {response}",
            flush=True,
        )
