"""Checks of the keys whose support depends on the model's architecture, read from the model folder's
``config.json`` with plain ``json`` (no model is loaded, nothing heavy is imported), called by
`fusedrl.config_checks.validate` so that a model a path cannot serve is named before Ray starts instead of
failing in a worker.

Every decoder architecture Transformers ships runs packed rows, shared prompts, compiled layers and
Ulysses (tests/unit/test_architectures.py: Llama, Qwen2/3, Mistral, Gemma 1-3, with sliding windows and
logit soft-capping). What remains:

- Ulysses splits the attention heads over the ranks of a sequence-parallel group: ``sp`` must divide
  ``num_attention_heads`` (key/value heads are repeated when they do not split).
- Logit soft-capping (Gemma 2's ``attn_logit_softcapping``) is not in PyTorch's SDPA, and Transformers'
  ``sdpa`` runs such a model without it: other log-probs than the model's (and vLLM's). ``auto`` caps them
  (fusedrl's CPU attention; FlashAttention-2 on CUDA), ``eager`` too.

A path without a ``config.json`` (a hub id, a test's placeholder) gets no check here.
"""

from __future__ import annotations

import json
import os
from typing import Any


def model_config(path: Any) -> dict[str, Any] | None:
    """The text model's entries of ``path``/config.json (a multimodal config's ``text_config`` over its
    own), or None when there is no readable one."""
    if not path:
        return None
    try:
        with open(os.path.join(str(path), "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def architecture_problems(run: Any, roles: dict[str, bool]) -> list[str]:
    """Problems of the architecture-dependent keys (module docstring); ``run``: the typed sections,
    ``roles``: the optional roles the run builds (`fusedrl.role_config.RunSections.needed_roles`)."""
    arr = "actor_rollout_ref"
    # (model path key, Ulysses key, attention key or None, and their values) of each model the run trains
    # or scores with
    models = [
        (
            f"{arr}.model.path",
            f"{arr}.actor.ulysses_sequence_parallel_size",
            f"{arr}.model.attn_implementation",
            (run.model.path, run.actor.ulysses_sequence_parallel_size, run.model.attn_implementation),
        )
    ]
    if roles.get("critic"):
        critic = run.critic
        models.append(
            (
                "critic.model.path",
                "critic.ulysses_sequence_parallel_size",
                "critic.model.attn_implementation",
                (critic.model.path, critic.ulysses_sequence_parallel_size, critic.model.attn_implementation),
            )
        )
    if roles.get("reward_model"):
        rm = run.reward_model
        models.append(
            (
                "reward_model.model.path",
                "reward_model.ulysses_sequence_parallel_size",
                None,
                (rm.model.path, rm.ulysses_sequence_parallel_size, None),
            )
        )
    problems: list[str] = []
    for _, sp_key, attn_key, (path, sp, attn) in models:
        config = model_config(path)
        if config is None:
            continue
        name = config.get("model_type", "this model")
        heads = config.get("num_attention_heads")
        if isinstance(sp, int) and sp > 1 and isinstance(heads, int) and heads % sp:
            divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            problems.append(
                f"`{sp_key}`={sp} does not divide the {heads} attention heads of {path}/config.json "
                f"({name}): Ulysses gives each rank of a sequence-parallel group heads / sp of them. "
                f"Use one of {divisors}."
            )
        softcap = config.get("attn_logit_softcapping")
        if softcap is not None and attn == "sdpa":
            problems.append(
                f"`{attn_key}`=sdpa: {name} caps its attention logits (attn_logit_softcapping={softcap} in "
                f"{path}/config.json), which PyTorch's SDPA cannot do, so its log-probs would not be the "
                "model's (nor the rollout's). Use auto (fusedrl's CPU attention or FlashAttention-2 cap "
                "them) or eager."
            )
    return problems
