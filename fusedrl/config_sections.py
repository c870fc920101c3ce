"""Pieces of the config checks: the numeric check every section uses (`check_number`, `positive`), the
checks of nested typed sections their parents call from ``problems()`` (rollout correction, checkpoint
contents, an optimizer's schedule), and checks that read keys of several sections (token budgets, compiled
layers, the keys that may be ``auto``; `fusedrl.config_cross_checks` calls them). Each problem names the key
and the fix."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf


def one_of(values: Sequence[Any]) -> str:
    """An allowed-value list as a message reads it (``a, b or c``): messages name the values their list holds."""
    names = [str(v) for v in values]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path: transformers and vLLM download it (machines with a network)."""
    import os
    import re

    return not os.path.exists(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None


def check_number(
    value: Any, key: str, problems: list[str], kind: type = int, *, optional: bool = False
) -> Any:
    """``value`` (of ``key``) as ``kind``, or None plus one problem in ``problems``: the one numeric check of
    the PPO and SFT validators. Booleans and None (unless ``optional``) are refused, and an integer key
    refuses a fractional number (``2.5``; ``2.0`` is 2) instead of truncating it."""
    if value is None and optional:
        return None
    try:
        if isinstance(value, bool) or value is None:
            raise TypeError
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        problems.append(f"`{key}`={value!r}: must be {what}{' or null' if optional else ''}.")
        return None


def positive(value: Any, key: str, problems: list[str]) -> int | None:
    """``value`` (of ``key``) as an integer >= 1, or None plus one problem (`check_number`'s, or >= 1)."""
    number = check_number(value, key, problems)
    if number is not None and number < 1:
        problems.append(f"`{key}`={number}: must be >= 1.")
        return None
    return number


def valid_positive(value: Any) -> int | None:
    """``value`` as an integer >= 1, or None, reporting nothing: for checks that combine numbers whose own
    section reports them."""
    return positive(value, "", [])


def shown(value: Any) -> Any:
    """A typed section's value as the YAML wrote it, for messages (its tuples were lists)."""
    return [shown(v) for v in value] if isinstance(value, tuple) else value


def rollout_correction_problems(rc: Any, problems: list[str]) -> None:
    """``algorithm.rollout_correction`` (a `fusedrl.role_config.RolloutCorrectionConfig`)."""
    from fusedrl.algorithms.rollout_correction import (
        IS_LEVELS,
        LOSS_TYPES,
        RS_OPTIONS,
        parse_rs_options,
        parse_rs_thresholds,
    )

    key = "algorithm.rollout_correction"
    if rc.rollout_is is not None and rc.rollout_is not in IS_LEVELS:
        problems.append(f"`{key}.rollout_is`={rc.rollout_is!r}: use {', '.join(IS_LEVELS)} or null.")
    if rc.rollout_is is not None:
        threshold = rc.rollout_is_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
            problems.append(f"`{key}.rollout_is_threshold`={threshold!r}: must be a number > 0.")
    if rc.rollout_rs is not None:
        options: list[str] | None = None
        try:
            options = parse_rs_options(str(rc.rollout_rs))
        except ValueError:
            problems.append(
                f"`{key}.rollout_rs`={rc.rollout_rs!r}: use one of {', '.join(RS_OPTIONS)}, or several joined "
                "by commas (a token must pass all)."
            )
        threshold_help = (
            'give an upper bound U (lower 1/U) or "lower_upper" for token / sequence / geometric / *_k1, one '
            "upper bound for *_k2 / *_k3; one value for all options or one per option, comma-separated."
        )
        if rc.rollout_rs_threshold is None:
            problems.append(f"`{key}.rollout_rs_threshold`=None: rollout_rs needs it; {threshold_help}")
        elif options is not None:
            try:
                parse_rs_thresholds(options, rc.rollout_rs_threshold)
            except (TypeError, ValueError) as err:
                problems.append(
                    f"`{key}.rollout_rs_threshold`={rc.rollout_rs_threshold!r}: {err}; {threshold_help}"
                )
    if rc.loss_type not in LOSS_TYPES:
        problems.append(f"`{key}.loss_type`={rc.loss_type!r}: use {' or '.join(LOSS_TYPES)}.")
    elif rc.loss_type == "reinforce" and not rc.bypass_mode:
        problems.append(
            f"`{key}.loss_type`=reinforce applies in bypass mode only (verl ignores it otherwise): set "
            f"`{key}.bypass_mode`=true, or loss_type=ppo_clip."
        )


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def checkpoint_contents_problems(checkpoint: Any, problems: list[str]) -> None:
    """``actor.checkpoint.{save,load}_contents``: fusedrl's checkpoints always hold model, optimizer and
    driver state (a partial one could not resume exactly); ``hf_model`` adds a Hugging Face folder."""
    for leaf in ("save_contents", "load_contents"):
        key = f"actor_rollout_ref.actor.checkpoint.{leaf}"
        value = getattr(checkpoint, leaf)
        items = [str(value)] if isinstance(value, str) else [str(v) for v in value]
        unknown = [v for v in items if v not in CHECKPOINT_CONTENTS]
        missing = [v for v in ("model", "optimizer", "extra") if v not in items]
        if unknown:
            problems.append(f"`{key}`={items}: unknown {unknown}; use {', '.join(CHECKPOINT_CONTENTS)}.")
        elif missing:
            problems.append(
                f"`{key}`={items}: fusedrl always {'saves' if leaf == 'save_contents' else 'loads'} model, "
                f"optimizer and extra (a resume restores them all); add {missing}."
            )


def schedule_problems(optim: Any, prefix: str, problems: list[str]) -> None:
    """The learning-rate schedule keys of one optimizer (``actor_rollout_ref.actor.optim`` / ``critic.optim``,
    a `fusedrl.role_config.OptimConfig`)."""
    from fusedrl.lr_schedule import SCHEDULERS

    style = optim.warmup_style if optim.warmup_style is not None else optim.lr_scheduler_type
    key = "warmup_style" if optim.warmup_style is not None else "lr_scheduler_type"
    if style not in SCHEDULERS:
        problems.append(f"`{prefix}.{key}`={style!r}: use {one_of(SCHEDULERS)}.")
    for leaf, low, high in (("lr_warmup_steps_ratio", 0.0, 1.0), ("min_lr_ratio", 0.0, 1.0)):
        value = getattr(optim, leaf)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            problems.append(f"`{prefix}.{leaf}`={value!r}: must be a number in [{low}, {high}].")
    steps = optim.lr_warmup_steps
    if isinstance(steps, bool) or not isinstance(steps, int):
        problems.append(f"`{prefix}.lr_warmup_steps`={steps!r}: must be an integer (-1: use the ratio).")


# (switch, token budget) pairs of dynamic batch size, each as its key path and how the typed sections
# (`fusedrl.role_config.RunSections`) hold it; the budgets are checked only where the switch is on.
_ARR = "actor_rollout_ref"
_TOKEN_BUDGETS: tuple[tuple[str, str, Callable[[Any], Any], Callable[[Any], Any]], ...] = (
    (
        f"{_ARR}.actor.use_dynamic_bsz",
        f"{_ARR}.actor.ppo_max_token_len_per_gpu",
        lambda run: run.actor.use_dynamic_bsz,
        lambda run: run.actor.ppo_max_token_len_per_gpu,
    ),
    (
        f"{_ARR}.rollout.log_prob_use_dynamic_bsz",
        f"{_ARR}.rollout.log_prob_max_token_len_per_gpu",
        lambda run: run.rollout.log_prob_use_dynamic_bsz,
        lambda run: run.rollout.log_prob_max_token_len_per_gpu,
    ),
    (
        f"{_ARR}.ref.log_prob_use_dynamic_bsz",
        f"{_ARR}.ref.log_prob_max_token_len_per_gpu",
        lambda run: run.ref.log_prob_use_dynamic_bsz,
        lambda run: run.ref.log_prob_max_token_len_per_gpu,
    ),
    (
        "critic.use_dynamic_bsz",
        "critic.ppo_max_token_len_per_gpu",
        lambda run: run.critic.use_dynamic_bsz,
        lambda run: run.critic.ppo_max_token_len_per_gpu,
    ),
    (
        "critic.use_dynamic_bsz",
        "critic.forward_max_token_len_per_gpu",
        lambda run: run.critic.use_dynamic_bsz,
        lambda run: run.critic.forward_max_token_len_per_gpu,
    ),
)


def budget_interpolations(cfg: DictConfig) -> dict[str, str]:
    """The token-budget keys written as an interpolation of another key (``${...}``), each with the key it
    follows. The one read of the raw tree the cross-section checks need: the typed sections hold the
    resolved value only, and the budget's problem says where that value came from."""
    follows: dict[str, str] = {}
    for _, key, _, _ in _TOKEN_BUDGETS:
        parent, leaf = key.rsplit(".", 1)
        section = OmegaConf.select(cfg, parent, throw_on_missing=False)
        node = section._get_node(leaf) if isinstance(section, DictConfig) else None
        if node is not None and node._is_interpolation():
            follows[key] = str(node._value())[2:-1]
    return follows


def token_budget_problems(
    run: Any, roles: Mapping[str, bool], follows: Mapping[str, str] | None = None
) -> list[str]:
    """Dynamic batch size: every token budget in use must hold one whole sequence (prompt + response).
    ``run``: the typed sections; ``roles``: the optional roles the run builds; ``follows``: the budgets
    that interpolate another key (`budget_interpolations`)."""
    follows = follows or {}
    try:
        longest = int(run.data.max_prompt_length) + int(run.data.max_response_length)
    except (TypeError, ValueError):
        return []  # reported by the data.* checks
    problems = []
    for switch, key, switch_of, budget_of in _TOKEN_BUDGETS:
        if not switch_of(run) or (key.startswith("critic.") and not roles["critic"]):
            continue
        if key.startswith(f"{_ARR}.ref.") and not roles["ref"]:
            continue
        node = budget_of(run)
        inherited = f" (it follows `{follows[key]}`)" if key in follows else ""
        try:
            budget = int(node)
        except (TypeError, ValueError):
            problems.append(f"`{key}`={node!r}: must be an integer number of tokens.")
            continue
        if budget < longest:
            problems.append(
                f"`{key}`={budget}{inherited}: a micro-batch must hold one whole sequence, and "
                f"data.max_prompt_length + data.max_response_length = {longest}. Set it to at least {longest} "
                f"(or `{switch}=false`)."
            )
    return problems


def compile_layers_problems(run: Any, *, with_critic: bool) -> list[str]:
    """``model.compile_layers`` (`fusedrl.workers.layer_compile`) takes neither LoRA nor Ulysses (not
    supported compiled yet). ``run``: the typed sections; ``with_critic``: the run builds a critic, so
    ``critic.model.compile_layers`` is checked too."""
    found: list[str] = []
    # (section, its compile_layers, [(key, value, the one value compiled layers support)])
    checks = [
        (
            f"{_ARR}.model",
            run.model.compile_layers,
            [
                (f"{_ARR}.model.lora_rank", run.model.lora_rank, 0),
                (f"{_ARR}.actor.ulysses_sequence_parallel_size", run.actor.ulysses_sequence_parallel_size, 1),
            ],
        )
    ]
    if with_critic:
        checks.append(
            (
                "critic.model",
                run.critic.model.compile_layers,
                [("critic.ulysses_sequence_parallel_size", run.critic.ulysses_sequence_parallel_size, 1)],
            )
        )
    for section, compile_layers, keys in checks:
        # auto never compiles with LoRA or Ulysses (`fusedrl.auto_defaults.compiles_for`): only true is refused
        if compile_layers is not True:
            continue
        for key, value, allowed in keys:
            if value != allowed:
                found.append(
                    f"`{section}.compile_layers`=true with `{key}`={value}: compiled layers run without LoRA "
                    f"or Ulysses. Set `{key}`={allowed}, or `{section}.compile_layers=false`."
                )
    return found


# The keys whose default is ``auto`` (resolved per device on the worker: `fusedrl.auto_defaults`).
AUTO_DTYPE_KEYS = (
    f"{_ARR}.actor.fsdp_config.param_dtype",
    f"{_ARR}.ref.fsdp_config.param_dtype",
    "critic.model.fsdp_config.param_dtype",
)
AUTO_SWITCH_KEYS = (
    f"{_ARR}.model.use_remove_padding",
    f"{_ARR}.model.compile_layers",
    "critic.model.use_remove_padding",
    "critic.model.compile_layers",
)


def auto_key_problems(run: Any) -> list[str]:
    """The keys that take ``auto`` (``run``: the typed sections) hold ``auto`` or a value the workers can
    use: a dtype name or null for the dtypes, true / false for the switches (``bool("ture")`` would
    otherwise read as true)."""
    from fusedrl.workers.fsdp import DTYPES

    found: list[str] = []
    dtypes = (
        run.actor.fsdp_config.param_dtype,
        run.ref.fsdp_config.param_dtype,
        run.critic.model.fsdp_config.param_dtype,
    )
    for key, value in zip(AUTO_DTYPE_KEYS, dtypes, strict=True):
        if value is not None and value != "auto" and value not in DTYPES:
            found.append(
                f"`{key}`={value!r}: use auto, null (model_dtype) or one of {', '.join(sorted(DTYPES))}."
            )
    switches = (
        run.model.use_remove_padding,
        run.model.compile_layers,
        run.critic.model.use_remove_padding,
        run.critic.model.compile_layers,
    )
    for key, value in zip(AUTO_SWITCH_KEYS, switches, strict=True):
        if value not in (True, False, "auto"):
            found.append(f"`{key}`={value!r}: use auto, true or false.")
    return found
