"""Turn decoded responses into token-level scores with a rule scoring function.

A reward manager is called as ``manager(batch) -> (token_level_scores [B, Tr] float32, metrics)``. It
decodes the valid part of every response (``response_mask``, special tokens skipped), scores it, and puts
the score on the response's last valid token. Three kinds share decoding, result checking, the error
policy, placement and metrics:

- `NaiveRewardManager`: one ``compute_score`` call per sample, inline or in worker processes with a
  per-sample time limit;
- `BatchRewardManager`: one call with the whole batch as lists;
- `DAPORewardManager`: naive plus DAPO's overlong reward shaping (arXiv 2503.14476).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.rewards.pool import (
    ON_ERROR_CHOICES,
    START_METHODS,
    Outcome,
    RemoteError,
    ScoringPool,
    call_inline,
)
from fusedrl.rewards.rules import default_compute_score, default_compute_score_batch

logger = logging.getLogger(__name__)


@dataclass
class _Decoded:
    """The batch as the scoring functions see it. Lists have one entry per sample."""

    texts: list[str]
    lengths: list[int]  # valid response tokens (EOS included)
    last_index: torch.Tensor  # [B] index of the last valid token; meaningless where the length is 0
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[Any]
    width: int  # Tr
    device: torch.device


class _RewardManager:
    """Shared machinery; subclasses implement `_score` (and may reshape scores in `_shape`)."""

    kind = "reward manager"

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None,
        *,
        on_error: str = "raise",
        reward_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(
                f"{type(self).__name__}: on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}"
            )
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.on_error = on_error
        self.reward_kwargs = dict(reward_kwargs or {})

    # ------------------------------------------------------------------ subclass hooks
    def _score(self, decoded: _Decoded) -> list[Outcome | None]:
        """One outcome per sample; None where there is nothing to score (an empty response)."""
        raise NotImplementedError

    def _shape(self, decoded: _Decoded, scores: list[float], metrics: dict[str, float]) -> list[float]:
        """Adjust the per-sample scores before they are placed (DAPO's overlong penalty)."""
        return scores

    # ------------------------------------------------------------------ the call
    def __call__(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(token_level_scores [B, Tr] float32, metrics)``; the score sits on the last valid token."""
        decoded = self._decode(batch)
        outcomes = self._score(decoded)
        b = len(decoded.texts)
        scores = [0.0] * b
        errors = timeouts = 0
        failures: list[str] = []
        extras: dict[str, list[float]] = defaultdict(list)
        # Per-sample extra entries of the last call (e.g. ``acc``), read by DAPO's filter_groups.metric.
        self.last_sample_extras: list[dict[str, float]] = [{} for _ in range(b)]
        for i, outcome in enumerate(outcomes):
            if outcome is None:
                continue  # an empty response earns nothing and has no token to carry a score
            source = decoded.data_sources[i]
            try:
                score, sample_extras = self._check(outcome, i, source)
            except RuntimeError as err:
                if self.on_error == "raise":
                    raise
                errors += 1
                timeouts += int(outcome.timed_out)
                failures.append(str(err))
                continue
            if not math.isfinite(score):
                errors += 1
                logger.warning("non-finite reward %r for sample %d (%s); using 0", score, i, source)
                continue
            scores[i] = score
            self.last_sample_extras[i] = dict(sample_extras)
            for key, value in sample_extras.items():
                extras[key].append(value)

        if failures:
            logger.warning(
                "%d of %d samples failed to score and score 0 (reward_model.on_error=zero); first: %s",
                len(failures),
                b,
                failures[0],
            )
        metrics: dict[str, float] = {}
        scores = self._shape(decoded, scores, metrics)
        token_level_scores = torch.zeros((b, decoded.width), dtype=torch.float32, device=decoded.device)
        by_source: dict[str, list[float]] = defaultdict(list)
        for source, score in zip(decoded.data_sources, scores):
            by_source[source].append(score)
        placed = [i for i, n in enumerate(decoded.lengths) if n > 0]  # an empty response has no token
        token_level_scores[placed, decoded.last_index[placed]] = torch.tensor(
            [scores[i] for i in placed], dtype=torch.float32, device=decoded.device
        )
        values = torch.tensor(scores, dtype=torch.float32)
        metrics.update(
            {
                "reward/score/mean": values.mean().item() if b else 0.0,
                "reward/score/max": values.max().item() if b else 0.0,
                "reward/score/min": values.min().item() if b else 0.0,
                "reward/errors": float(errors),
                "reward/timeouts": float(timeouts),
                "reward/empty_responses": float(sum(n == 0 for n in decoded.lengths)),
            }
        )
        for source, source_scores in by_source.items():
            metrics[f"reward/{source}/score/mean"] = sum(source_scores) / len(source_scores)
        for key, extra_values in extras.items():
            metrics[f"reward/extra/{key}/mean"] = sum(extra_values) / len(extra_values)
        return token_level_scores, metrics

    def close(self) -> None:
        """Release worker processes, if any (a no-op for inline scoring)."""

    # ------------------------------------------------------------------ helpers
    def _decode(self, batch: RolloutBatch) -> _Decoded:
        name = type(self).__name__
        if batch.responses is None or batch.response_mask is None:
            raise ValueError(f"{name}: the batch has no responses yet (run generate first)")
        responses = batch.responses  # [B, Tr]
        mask = batch.response_mask.bool()  # [B, Tr]
        b, tr = responses.shape
        data_sources = batch.field_list("data_source")
        ground_truths = batch.field_list("ground_truth")
        extra_infos = batch.field_list("extra_info") or [{} for _ in range(b)]
        for field, values in (
            ("data_source", data_sources),
            ("ground_truth", ground_truths),
            ("extra_info", extra_infos),
        ):
            if len(values) != b:
                raise ValueError(f"{name}: batch has {len(values)} {field} values for {b} samples")
        positions = torch.arange(tr, device=responses.device).expand(b, tr)  # [B, Tr]
        last_index = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values  # [B]
        lengths = mask.sum(dim=1).tolist()
        valid = responses[mask].tolist()  # every row's valid tokens, row after row: one tensor op, not B
        ends = list(itertools.accumulate(lengths))
        rows = [valid[end - n : end] for n, end in zip(lengths, ends)]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return _Decoded(
            texts=list(texts),
            lengths=lengths,
            last_index=last_index,
            data_sources=[str(s) for s in data_sources],
            ground_truths=ground_truths,
            extra_infos=extra_infos,
            width=tr,
            device=responses.device,
        )

    def _check(self, outcome: Outcome, i: int, data_source: str) -> tuple[float, dict[str, float]]:
        """The sample's score and extra numeric entries; RuntimeError naming the sample on any failure."""
        err = outcome.error
        if err is not None:
            if outcome.timed_out:
                cause = f"timed out ({err})"
            elif isinstance(err, RemoteError):
                cause = str(err)
            else:
                cause = f"{type(err).__name__}: {err}"
            raise RuntimeError(
                f"reward function failed on sample {i} (data_source={data_source!r}): {cause}"
            ) from err
        result = outcome.value
        sample_extras: dict[str, float] = {}
        if isinstance(result, Mapping):
            if "score" not in result:
                raise RuntimeError(
                    f"reward function returned a dict without 'score' for sample {i} "
                    f"(data_source={data_source!r}); keys: {sorted(result)}"
                )
            for key, value in result.items():
                if key != "score" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    sample_extras[key] = float(value)
            result = result["score"]
        try:
            return float(result), sample_extras
        except (TypeError, ValueError) as exc:
            raise RuntimeError(
                f"reward function returned {result!r} for sample {i} (data_source={data_source!r}); "
                f"expected a number or a dict with a numeric 'score'"
            ) from exc


class NaiveRewardManager(_RewardManager):
    """Scores every response of a batch, one call of ``compute_score`` per sample.

    ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`` returns a
    float, or a dict with the reward under ``"score"`` (other numeric entries become
    ``reward/extra/<key>/mean`` metrics). Default: `default_compute_score`.

    ``num_workers=0`` scores inline on the driver, without a time limit. ``num_workers>0`` scores in that
    many worker processes (`ScoringPool`, started with ``mp_context``), each sample limited to
    ``timeout_s`` seconds: a scorer that overruns is killed. A failing or timed-out sample either stops
    the step with a RuntimeError naming the sample index, data source and cause (``on_error="raise"``) or
    scores 0 and is counted in ``reward/errors`` (and ``reward/timeouts``) (``on_error="zero"``). A
    non-finite score is always replaced by 0 and counted in ``reward/errors``.

    Metrics: ``reward/score/{mean,max,min}``, ``reward/errors``, ``reward/timeouts``,
    ``reward/empty_responses``, ``reward/<data_source>/score/mean`` and ``reward/extra/<key>/mean``.
    """

    kind = "naive"

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        *,
        num_workers: int = 0,
        timeout_s: float | None = 10.0,
        on_error: str = "raise",
        mp_context: str = "forkserver",
        reward_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            tokenizer,
            compute_score if compute_score is not None else default_compute_score,
            on_error=on_error,
            reward_kwargs=reward_kwargs,
        )
        if num_workers < 0:
            raise ValueError(f"{type(self).__name__}: num_workers must be >= 0, got {num_workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"{type(self).__name__}: timeout_s must be > 0 (or None), got {timeout_s}")
        if mp_context not in START_METHODS:
            raise ValueError(
                f"{type(self).__name__}: mp_context must be one of {START_METHODS}, got {mp_context!r}"
            )
        self.num_workers = int(num_workers)
        self.timeout_s = timeout_s
        self.mp_context = mp_context
        self._pool: ScoringPool | None = None

    def _score(self, decoded: _Decoded) -> list[Outcome | None]:
        outcomes: list[Outcome | None] = [None] * len(decoded.texts)
        todo = [i for i, n in enumerate(decoded.lengths) if n > 0]
        calls = [
            dict(
                data_source=decoded.data_sources[i],
                solution_str=decoded.texts[i],
                ground_truth=decoded.ground_truths[i],
                extra_info=decoded.extra_infos[i],
                **self.reward_kwargs,
            )
            for i in todo
        ]
        if self.num_workers == 0:
            for i, call in zip(todo, calls):
                outcome = call_inline(self.compute_score, call)
                outcomes[i] = outcome
                if outcome.error is not None and self.on_error == "raise":
                    break  # the step stops at this sample: score no more
        else:
            for i, outcome in zip(todo, self.pool.map(calls)):
                outcomes[i] = outcome
        return outcomes

    @property
    def pool(self) -> ScoringPool:
        """The worker pool (started on first use; only with ``num_workers > 0``)."""
        if self._pool is None:
            if self.num_workers == 0:
                raise RuntimeError(f"{type(self).__name__} scores inline (num_workers=0): it has no pool")
            self._pool = ScoringPool(self.compute_score, self.num_workers, self.timeout_s, self.mp_context)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def overlong_penalty(length: int, max_length: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), scaled by ``penalty_factor``.

    0 up to ``max_length - buffer_len`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_length`` (and staying there): ``-min((length - (max_length - buffer_len)) / buffer_len, 1) * f``.
    """
    exceed = length - (max_length - buffer_len)
    if exceed <= 0:
        return 0.0
    return -min(exceed / buffer_len, 1.0) * penalty_factor


class DAPORewardManager(NaiveRewardManager):
    """`NaiveRewardManager` plus DAPO's overlong reward shaping.

    With ``overlong_buffer_enable``, a response of ``l`` valid tokens (EOS included) gets
    `overlong_penalty` ``(l, L, overlong_buffer_len, overlong_penalty_factor)`` added to its score, where
    ``L`` is ``max_response_length`` (default: the batch's response width ``Tr``). The placed score and
    the ``reward/score/*`` and per-source metrics include the penalty; ``reward/overlong_penalty/mean``
    reports the mean penalty over the batch (0 while disabled). Empty responses are not penalised.
    """

    kind = "dapo"

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        *,
        overlong_buffer_enable: bool = False,
        overlong_buffer_len: int = 1024,
        overlong_penalty_factor: float = 1.0,
        max_response_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, compute_score, **kwargs)
        if overlong_buffer_enable:
            if not overlong_buffer_len > 0:
                raise ValueError(
                    f"reward_model.overlong_buffer.len must be > 0 tokens, got {overlong_buffer_len}"
                )
            if not overlong_penalty_factor >= 0:
                raise ValueError(
                    f"reward_model.overlong_buffer.penalty_factor must be >= 0, got {overlong_penalty_factor}"
                )
            if max_response_length is not None and max_response_length < overlong_buffer_len:
                raise ValueError(
                    f"reward_model.overlong_buffer.len={overlong_buffer_len} exceeds the max response length "
                    f"{max_response_length} (data.max_response_length)"
                )
        self.overlong_buffer_enable = bool(overlong_buffer_enable)
        self.overlong_buffer_len = int(overlong_buffer_len)
        self.overlong_penalty_factor = float(overlong_penalty_factor)
        self.max_response_length = None if max_response_length is None else int(max_response_length)

    def _shape(self, decoded: _Decoded, scores: list[float], metrics: dict[str, float]) -> list[float]:
        if not self.overlong_buffer_enable:
            metrics["reward/overlong_penalty/mean"] = 0.0
            return scores
        max_length = self.max_response_length if self.max_response_length is not None else decoded.width
        if max_length < self.overlong_buffer_len:
            raise ValueError(
                f"reward_model.overlong_buffer.len={self.overlong_buffer_len} exceeds the max response "
                f"length {max_length}"
            )
        penalties = [
            overlong_penalty(n, max_length, self.overlong_buffer_len, self.overlong_penalty_factor)
            if n > 0
            else 0.0
            for n in decoded.lengths
        ]
        metrics["reward/overlong_penalty/mean"] = sum(penalties) / len(penalties) if penalties else 0.0
        return [score + penalty for score, penalty in zip(scores, penalties)]


class BatchRewardManager(_RewardManager):
    """Scores the whole batch with ONE call of a list-in, list-out function.

    ``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs)`` gets
    one list entry per sample (empty responses included, as ``""``) and returns a list of the same length
    of floats or dicts (as for `NaiveRewardManager`); scores of empty responses are ignored (they score 0).
    Default: `default_compute_score` applied to each sample. The call runs inline, without a time limit.
    If it raises (or returns the wrong number of results), ``on_error="raise"`` stops the step and
    ``on_error="zero"`` scores every sample 0, counting each in ``reward/errors``.
    """

    kind = "batch"

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        *,
        on_error: str = "raise",
        reward_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            tokenizer,
            compute_score if compute_score is not None else default_compute_score_batch,
            on_error=on_error,
            reward_kwargs=reward_kwargs,
        )

    def _score(self, decoded: _Decoded) -> list[Outcome | None]:
        b = len(decoded.texts)
        try:
            results = list(
                self.compute_score(
                    data_sources=list(decoded.data_sources),
                    solution_strs=list(decoded.texts),
                    ground_truths=list(decoded.ground_truths),
                    extra_infos=list(decoded.extra_infos),
                    **self.reward_kwargs,
                )
            )
            if len(results) != b:
                raise ValueError(f"it returned {len(results)} results for {b} samples")
        except Exception as exc:
            message = (
                f"batch reward function failed on a batch of {b} samples "
                f"(data sources {sorted(set(decoded.data_sources))}): {type(exc).__name__}: {exc}"
            )
            if self.on_error == "raise":
                raise RuntimeError(message) from exc
            failed = Outcome(error=RuntimeError(message))
            return [failed if n > 0 else None for n in decoded.lengths]
        return [Outcome(value=result) if n > 0 else None for result, n in zip(results, decoded.lengths)]
