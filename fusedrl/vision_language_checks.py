"""Config checks of a vision-language policy (a Qwen2-VL / Qwen2.5-VL model folder: docs/multimodal.md), run by
`fusedrl.config_checks.validate` before Ray starts. The image path is built and tested for the fused pool's
single-turn synchronous rollouts (full fine-tuning or LoRA, packed or padded rows, gradient checkpointing, a
frozen or trained vision tower, one or more workers); what it has not been built for is refused here, each problem
naming the key and the fix, instead of when the workers start (or, for the paths that send the engine no images,
never)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ARR = "actor_rollout_ref"


def vision_language_problems(run: Any, roles: Mapping[str, bool]) -> list[str]:
    """The problems of a run whose model is a vision-language model (empty for a text model); ``run``: the
    typed sections, ``roles``: the optional roles it builds."""
    from fusedrl.models.qwen_vl import is_vision_language_model

    path = run.model.path
    if path is None or not is_vision_language_model(str(path)):
        return []
    what = f"`{ARR}.model.path` ({path}) is a vision-language model"
    placed = dict(run.trainer.placement.roles or {})
    # (key, its value, whether the value is supported, the fix)
    checks = [
        (
            f"{ARR}.model.compile_layers",
            run.model.compile_layers,
            run.model.compile_layers is not True,
            "compiled layers are not built for it. Set false or auto (auto leaves it eager).",
        ),
        (
            f"{ARR}.actor.ulysses_sequence_parallel_size",
            run.actor.ulysses_sequence_parallel_size,
            int(run.actor.ulysses_sequence_parallel_size or 1) == 1,
            "Ulysses sequence parallelism is not built for its image rows. Set 1.",
        ),
        (
            f"{ARR}.rollout.multi_turn.enable",
            run.rollout.multi_turn.enable,
            not run.rollout.multi_turn.enable,
            "agent loops send the engine no images. Set false.",
        ),
        (
            "async_training.partial_rollout",
            run.async_training.partial_rollout,
            not run.async_training.partial_rollout,
            "paused and resumed requests send the engine no images. Set false.",
        ),
        (
            "trainer.placement.roles",
            run.trainer.placement.roles,
            "rollout" not in placed,
            "a rollout pool of its own (the broadcast weight route) has not been run with one. Keep the "
            "rollout in the fused pool (drop its placement).",
        ),
        (
            "algorithm.adv_estimator",
            run.algorithm.adv_estimator,
            not roles.get("critic"),
            "a critic on image prompts is not built. Use a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...).",
        ),
    ]
    return [f"`{key}`={value}: {what}; {msg}" for key, value, ok, msg in checks if not ok]
