"""Turn decoded responses into token-level scores with a rule scoring function."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.rewards import default_compute_score

logger = logging.getLogger(__name__)


class NaiveRewardManager:
    """Scores every response of a batch, one call of ``compute_score`` per sample, on the driver.

    ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` returns a float, or a dict
    with the reward under ``"score"`` (other numeric entries become ``reward/extra/<key>/mean`` metrics).
    The response text is the decoded valid part of the response (``response_mask``) with special tokens
    skipped. A non-finite score is replaced by 0 and counted in ``reward/errors``; an exception inside
    ``compute_score`` stops the step with the sample index and data source.
    """

    def __init__(self, tokenizer, compute_score: Callable[..., Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score

    def __call__(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(token_level_scores [B, Tr] float32, metrics)``; the score sits on the last valid token."""
        if batch.responses is None or batch.response_mask is None:
            raise ValueError("NaiveRewardManager: the batch has no responses yet (run generate first)")
        responses = batch.responses  # [B, Tr]
        mask = batch.response_mask.bool()  # [B, Tr]
        b, tr = responses.shape
        data_sources = batch.field_list("data_source")
        ground_truths = batch.field_list("ground_truth")
        extra_infos = batch.field_list("extra_info") or [{} for _ in range(b)]
        for name, values in (("data_source", data_sources), ("ground_truth", ground_truths)):
            if len(values) != b:
                raise ValueError(f"NaiveRewardManager: batch has {len(values)} {name} values for {b} samples")

        lengths = mask.sum(dim=1)  # [B]
        # Index of the last valid token per row (argmax of position * mask); meaningless where length is 0.
        positions = torch.arange(tr, device=responses.device).expand(b, tr)  # [B, Tr]
        last_index = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values  # [B]
        texts = self.tokenizer.batch_decode(
            [responses[i][mask[i]].tolist() for i in range(b)], skip_special_tokens=True
        )

        scores = torch.zeros(b, dtype=torch.float32)
        token_level_scores = torch.zeros((b, tr), dtype=torch.float32, device=responses.device)  # [B, Tr]
        errors = 0
        extras: dict[str, list[float]] = defaultdict(list)
        by_source: dict[str, list[float]] = defaultdict(list)
        for i in range(b):
            if lengths[i] == 0:
                by_source[data_sources[i]].append(0.0)
                continue  # an empty response earns nothing and has no token to carry a score
            try:
                result = self.compute_score(
                    data_source=data_sources[i],
                    solution_str=texts[i],
                    ground_truth=ground_truths[i],
                    extra_info=extra_infos[i],
                )
            except Exception as exc:
                raise RuntimeError(
                    f"reward function failed on sample {i} (data_source={data_sources[i]!r}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            score = self._to_float(result, i, data_sources[i], extras)
            if not math.isfinite(score):
                errors += 1
                logger.warning("non-finite reward %r for sample %d (%s); using 0", score, i, data_sources[i])
                score = 0.0
            scores[i] = score
            token_level_scores[i, last_index[i]] = score
            by_source[data_sources[i]].append(score)

        metrics: dict[str, float] = {
            "reward/score/mean": scores.mean().item() if b else 0.0,
            "reward/score/max": scores.max().item() if b else 0.0,
            "reward/score/min": scores.min().item() if b else 0.0,
            "reward/errors": float(errors),
            "reward/empty_responses": float((lengths == 0).sum().item()),
        }
        if len(by_source) > 1:
            for source, values in by_source.items():
                metrics[f"reward/{source}/score/mean"] = sum(values) / len(values)
        for key, values in extras.items():
            metrics[f"reward/extra/{key}/mean"] = sum(values) / len(values)
        return token_level_scores, metrics

    @staticmethod
    def _to_float(result: Any, i: int, data_source: str, extras: dict[str, list[float]]) -> float:
        if isinstance(result, Mapping):
            if "score" not in result:
                raise RuntimeError(
                    f"reward function returned a dict without 'score' for sample {i} "
                    f"(data_source={data_source!r}); keys: {sorted(result)}"
                )
            for key, value in result.items():
                if key != "score" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    extras[key].append(float(value))
            result = result["score"]
        try:
            return float(result)
        except (TypeError, ValueError) as exc:
            raise RuntimeError(
                f"reward function returned {result!r} for sample {i} (data_source={data_source!r}); "
                f"expected a number or a dict with a numeric 'score'"
            ) from exc
