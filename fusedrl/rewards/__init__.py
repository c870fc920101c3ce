"""Reward functions, chosen per sample by the row's ``data_source``, and the reward managers.

A scoring function has the signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`` (a dict
must hold the reward under ``"score"``; its other numeric entries are reported as metrics).
`default_compute_score` is the built-in dispatcher; `load_custom_reward_function` loads a user's function
from a file; `build_reward_manager` builds the manager the trainer calls as
``manager(batch) -> (token_level_scores [B, Tr], metrics)``:

- ``naive``: one scoring call per sample (optionally in worker processes with a per-sample time limit);
- ``batch``: one call with the whole batch as lists;
- ``dapo``: ``naive`` plus DAPO's overlong reward shaping.

Built-in data sources: ``arithmetic``; ``openai/gsm8k`` / ``gsm8k``; ``lighteval/MATH``,
``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``, ``math``, ... (needs
``pip install math-verify``); ``countdown``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fusedrl.rewards.checks import reward_problems
from fusedrl.rewards.custom import FileRewardFunction, load_custom_reward_function
from fusedrl.rewards.rules import MATH_DATA_SOURCES, default_compute_score, default_compute_score_batch


def build_reward_manager(config: Any, tokenizer: Any, compute_score: Callable[..., Any] | None = None) -> Any:
    """The reward manager named by ``reward_model.reward_manager``, configured from ``config``.

    ``config`` is the trainer's typed `fusedrl.role_config.RoleConfigs` (or `load_config`'s `RunConfig`), or
    (library use, tests) a partial
    trainer config (DictConfig or plain dict) whose missing reward keys take the YAML's defaults
    (`typed_reward_sections`). Keys read:

    - ``reward_model.reward_manager``: ``naive`` | ``batch`` | ``dapo`` (naive)
    - ``reward_model.num_workers``: worker processes for naive/dapo; 0 scores inline, with no time limit (0)
    - ``reward_model.timeout_s``: per-sample time limit in seconds when num_workers > 0 (10.0)
    - ``reward_model.on_error``: ``raise`` | ``zero``: what a failing or timed-out sample does (raise)
    - ``reward_model.mp_context``: ``forkserver`` | ``spawn`` | ``fork``, how workers start (forkserver)
    - ``reward_model.reward_kwargs``: extra keyword arguments for every scoring call ({})
    - ``reward_model.overlong_buffer.{enable, len, penalty_factor}``: dapo's shaping (false, 1024, 1.0)
    - ``reward_model.overlong_buffer.max_resp_len``: dapo's L (null: ``data.max_response_length``, and
      without it the batch's response width)
    - ``custom_reward_function.path`` / ``.name``: a user's function file and name (null / compute_score)

    ``compute_score`` (a callable) overrides ``custom_reward_function``. A bad value raises ValueError
    naming the key (`reward_problems`); a bad custom file raises as `load_custom_reward_function` does.
    """
    from fusedrl.rewards.manager import BatchRewardManager, DAPORewardManager, NaiveRewardManager
    from fusedrl.role_config import RoleConfigs
    from fusedrl.run_config import RunConfig

    if isinstance(config, (RoleConfigs, RunConfig)):
        run = config
        rm, custom, max_len = run.reward_model, run.custom_reward_function, run.data.max_response_length
    else:
        rm, custom, max_len = typed_reward_sections(config)
    problems = reward_problems(rm)
    if problems:
        raise ValueError(problems[0])
    kind = rm.reward_manager
    reward_kwargs = dict(rm.reward_kwargs or {})

    fn = compute_score
    if fn is None and custom.path:
        file_fn = FileRewardFunction(custom.path, custom.name)
        file_fn.load()  # fail now, naming the file and function, rather than at the first step
        fn = file_fn

    overlong = rm.overlong_buffer
    if kind == "batch":
        return BatchRewardManager(tokenizer, fn, on_error=rm.on_error, reward_kwargs=reward_kwargs)
    common: dict[str, Any] = dict(
        num_workers=rm.num_workers,
        timeout_s=rm.timeout_s,
        on_error=rm.on_error,
        mp_context=rm.mp_context,
        reward_kwargs=reward_kwargs,
    )
    if kind == "dapo":
        return DAPORewardManager(
            tokenizer,
            fn,
            overlong_buffer_enable=bool(overlong.enable),
            overlong_buffer_len=int(overlong.len),
            overlong_penalty_factor=float(overlong.penalty_factor),
            # L: verl's reward_kwargs.max_resp_len when given, else data.max_response_length (None: the batch's width)
            max_response_length=overlong.max_resp_len if overlong.max_resp_len is not None else max_len,
            **common,
        )
    return NaiveRewardManager(tokenizer, fn, **common)


def typed_reward_sections(config: Any) -> tuple[Any, Any, int | None]:
    """A partial trainer config (DictConfig or plain dict; library use, tests) as the typed ``reward_model``
    and ``custom_reward_function`` sections, missing keys from the YAML (one set of defaults), and
    ``data.max_response_length`` (None when the config has none)."""
    from omegaconf import DictConfig, OmegaConf

    from fusedrl.role_config import CustomRewardFunctionConfig, RewardModelConfig, build_section

    cfg = config if isinstance(config, DictConfig) else OmegaConf.create(config or {})
    raw_kwargs = OmegaConf.select(cfg, "reward_model.reward_kwargs")
    if raw_kwargs is not None and not isinstance(raw_kwargs, DictConfig):
        raise ValueError(f"reward_model.reward_kwargs={raw_kwargs!r}: use a mapping of keyword arguments")
    merged = OmegaConf.merge(_yaml_reward_defaults(), cfg)
    plain: Any = OmegaConf.to_container(merged, resolve=True)
    rm = build_section(RewardModelConfig, plain["reward_model"], "reward_model")
    custom = build_section(
        CustomRewardFunctionConfig, plain["custom_reward_function"], "custom_reward_function"
    )
    return rm, custom, OmegaConf.select(cfg, "data.max_response_length")


def _yaml_reward_defaults() -> Any:
    """The ``reward_model`` and ``custom_reward_function`` sections of the trainer YAML."""
    from omegaconf import OmegaConf

    from fusedrl.config_base import trainer_yaml

    base = trainer_yaml()
    return OmegaConf.create(
        {"reward_model": base.reward_model, "custom_reward_function": base.custom_reward_function}
    )


def __getattr__(name: str):  # lazy: the managers import torch, the rule scorers do not
    if name in ("NaiveRewardManager", "BatchRewardManager", "DAPORewardManager"):
        from fusedrl.rewards import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchRewardManager",
    "DAPORewardManager",
    "FileRewardFunction",
    "MATH_DATA_SOURCES",
    "NaiveRewardManager",
    "build_reward_manager",
    "default_compute_score",
    "default_compute_score_batch",
    "load_custom_reward_function",
]
