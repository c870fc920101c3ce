"""LoRA settings (``actor_rollout_ref.model.lora_*``): what they mean and the config checks, no torch.

The adapters themselves come from ``peft`` and are built in the workers (`fusedrl.workers.lora`); this
module holds what the driver needs before anything starts: whether LoRA is on, the checks reported with
the other config problems, and how PEFT's parameter names map back onto the base model's (the names the
rollout engine and a Hugging Face export use).
"""

from __future__ import annotations

import json
import os
from typing import Any

ALL_LINEAR = "all-linear"
# PEFT wraps the model as ``base_model.model.<original>`` and moves each adapted layer's own weights to
# ``<layer>.base_layer.<param>``; the adapter's matrices live in ``<layer>.lora_A/B.<adapter>.weight``.
_PEFT_ROOT = "base_model.model."
_BASE_LAYER = ".base_layer"
ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude")
# The input embedding and LM head of a Hugging Face causal LM: one tensor when ``tie_word_embeddings`` is set.
TIED_MODULES = ("embed_tokens", "lm_head")


def tied_target_message(key: str, value: Any, names: list[str], path: Any) -> str:
    """The config error for an adapter on a tied embedding / LM head (``names``): the one fix is to leave
    them out."""
    return (
        f"`{key}`={value!r} adapts {', '.join(names)}, which {path} ties together "
        "(tie_word_embeddings=true: the LM head is the input embedding). An adapter there would untie them "
        "(the merged head no longer equals the embedding the engine and an export tie to it). Leave "
        f"{' and '.join(TIED_MODULES)} out of target_modules (all-linear already does) or add them to "
        "exclude_modules."
    )


def ties_embeddings(model_path: Any) -> bool:
    """Whether ``model_path``'s config.json sets ``tie_word_embeddings`` (False where unreadable or unset)."""
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))
    return bool(tied)


def lora_rank(model_cfg: Any) -> int:
    """``model.lora_rank`` as an int (0: LoRA off); ``model_cfg`` is the typed ``ModelConfig`` (or the
    driver's DictConfig section)."""
    return int(model_cfg.lora_rank)


def lora_enabled(model_cfg: Any) -> bool:
    """Whether the actor trains LoRA adapters (``lora_rank > 0`` or a saved adapter to start from)."""
    return lora_rank(model_cfg) > 0 or bool(model_cfg.lora_adapter_path)


def target_modules(value: Any) -> str | list[str]:
    """``model.target_modules`` in PEFT's form: ``all-linear`` (every linear layer but the LM head), a
    regex string, or a list of module names."""
    if isinstance(value, str):
        return value
    return [str(v) for v in value]


def is_adapter_name(name: str) -> bool:
    """Whether a PEFT state-dict name is an adapter tensor (``lora_A`` / ``lora_B`` ...)."""
    return any(marker in name for marker in ADAPTER_MARKERS)


def base_name(name: str) -> str:
    """The base model's name for a PEFT parameter name: ``base_model.model.x.q_proj.base_layer.weight``
    -> ``x.q_proj.weight`` (names without PEFT's parts pass through)."""
    if name.startswith(_PEFT_ROOT):
        name = name[len(_PEFT_ROOT) :]
    while (
        _BASE_LAYER + "." in name
    ):  # nested wrappers (one per adapted parameter of a module) nest base_layers
        name = name.replace(_BASE_LAYER + ".", ".")
    return name


def lora_active(model: Any) -> bool:
    """Whether the policy trains or loads LoRA (``actor_rollout_ref.model``, typed): a valid rank > 0, or an
    adapter to load."""
    rank = model.lora_rank
    valid = not isinstance(rank, bool) and isinstance(rank, int) and rank >= 0
    return valid and (rank > 0 or bool(model.lora_adapter_path))


def lora_problems(model: Any) -> list[str]:
    """Config problems of the LoRA keys of ``actor_rollout_ref.model`` (the typed `ModelConfig`, whose
    ``problems()`` calls this), each naming the key and the fix. With a critic: `lora_critic_problems`."""
    from fusedrl.config_sections import shown

    key = "actor_rollout_ref.model"
    problems: list[str] = []
    rank = model.lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        return [f"`{key}.lora_rank`={rank!r}: must be an integer >= 0 (0 switches LoRA off)."]
    path = model.lora_adapter_path
    if path and not os.path.isfile(os.path.join(str(path), "adapter_config.json")):
        problems.append(
            f"`{key}.lora_adapter_path`={path!r}: not a PEFT adapter folder (no adapter_config.json). "
            "Point it at a folder written by save_pretrained / fusedrl's export --adapter, or set it to null."
        )
    if rank == 0 and not path:
        return problems
    alpha = model.lora_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        problems.append(
            f"`{key}.lora_alpha`={alpha!r}: must be a number > 0 (the update is scaled by alpha/rank)."
        )
    targets = model.target_modules
    if not path and (
        targets is None or (not isinstance(targets, str) and len(targets) == 0) or targets == ""
    ):
        problems.append(
            f"`{key}.target_modules`={shown(targets)!r}: LoRA (lora_rank={rank}) needs the modules to adapt: "
            f"`{ALL_LINEAR}` or a list such as [q_proj,k_proj,v_proj,o_proj]."
        )
    named = [] if isinstance(targets, str) or targets is None else [str(t) for t in targets]
    excluded = model.exclude_modules
    excluded = [] if excluded is None or isinstance(excluded, str) else [str(e) for e in excluded]
    tied = [t for t in named if t.rsplit(".", 1)[-1] in TIED_MODULES and t not in excluded]
    if tied and ties_embeddings(model.path):
        problems.append(tied_target_message(f"{key}.target_modules", list(named), tied, model.path))
    return problems


def lora_critic_problems(model: Any, adv_estimator: Any, with_critic: bool) -> list[str]:
    """LoRA on the policy (``model``, typed) with an estimator that builds a critic, which has none: a
    cross-section check (`fusedrl.config_cross_checks`)."""
    if not (with_critic and lora_active(model)):
        return []
    return [
        f"`actor_rollout_ref.model.lora_rank`={model.lora_rank} with algorithm.adv_estimator={adv_estimator} "
        "(a critic): fusedrl's critic has no LoRA (it would train every parameter of a second model). Use a "
        "critic-free estimator (grpo, rloo, reinforce_plus_plus, ...) or set lora_rank=0."
    ]
