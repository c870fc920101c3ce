"""The built-in rule rewards, chosen per sample by the row's ``data_source``: `default_compute_score` (one
sample) and `default_compute_score_batch` (the ``batch`` manager's default). Re-exported by
`fusedrl.rewards`; the managers (`fusedrl.rewards.manager`) import them from here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from fusedrl.rewards import arithmetic, countdown, gsm8k, math_boxed

# data_source -> fn(solution_str, ground_truth, **kwargs) -> float
_RULE_SCORERS: dict[str, Callable[..., float]] = {
    "arithmetic": arithmetic.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "countdown": countdown.compute_score,
}
MATH_DATA_SOURCES = (
    "lighteval/MATH",
    "lighteval/MATH-Hard",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "EleutherAI/hendrycks_math",
    "hendrycks_math",
    "math",
    "math500",
)
_RULE_SCORERS.update(dict.fromkeys(MATH_DATA_SOURCES, math_boxed.compute_score))


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """Score one response with the built-in rule for its ``data_source``.

    ``kwargs`` (e.g. ``format_score=0.1``, from ``reward_model.reward_kwargs``) go to the rule scorer.
    """
    scorer = _RULE_SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r} (built-in: {sorted(_RULE_SCORERS)}); "
            f"write a compute_score(data_source, solution_str, ground_truth, extra_info) function and set "
            f"custom_reward_function.path (and custom_reward_function.name) to it"
        )
    return scorer(solution_str, ground_truth, **kwargs)


def _warm_up_builtin() -> None:
    """Import what the built-in rules import lazily, so a worker's first sample does not pay for it."""
    with contextlib.suppress(ImportError):
        import math_verify  # noqa: F401


# Worker processes call ``fn.warm_up()`` (when present) before their first sample.
default_compute_score.warm_up = _warm_up_builtin  # type: ignore[attr-defined]


def default_compute_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None],
    **kwargs: Any,
) -> list[float | dict]:
    """`default_compute_score` over lists: the default function of the ``batch`` manager."""
    return [
        default_compute_score(source, text, truth, extra, **kwargs)
        for source, text, truth, extra in zip(data_sources, solution_strs, ground_truths, extra_infos)
    ]
