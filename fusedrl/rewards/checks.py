"""What the reward manager refuses in a typed ``reward_model`` section (`reward_problems`), and the manager
kinds it builds (`MANAGER_KINDS`). A leaf module: `fusedrl.role_config.RewardModelConfig.problems` and
`fusedrl.rewards.build_reward_manager` both read it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MANAGER_KINDS = ("naive", "batch", "dapo")  # reward_model.reward_manager: what `build_reward_manager` builds


def reward_problems(rm: Any) -> list[str]:
    """Every problem of a typed ``reward_model`` section (`fusedrl.role_config.RewardModelConfig`) that the
    reward manager would refuse, each naming the key and the values it takes."""
    from fusedrl.rewards.pool import ON_ERROR_CHOICES, START_METHODS

    problems = []
    if not isinstance(rm.reward_kwargs, Mapping):
        problems.append(
            f"reward_model.reward_kwargs={rm.reward_kwargs!r}: use a mapping of keyword arguments"
        )
    if rm.reward_manager not in MANAGER_KINDS:
        problems.append(
            f"reward_model.reward_manager={rm.reward_manager!r}: use one of {list(MANAGER_KINDS)}"
        )
    if rm.on_error not in ON_ERROR_CHOICES:
        problems.append(f"reward_model.on_error={rm.on_error!r}: use one of {list(ON_ERROR_CHOICES)}")
    num_workers = rm.num_workers
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        problems.append(f"reward_model.num_workers={num_workers!r}: use an integer >= 0 (0 scores inline)")
    timeout_s = rm.timeout_s
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        problems.append(
            f"reward_model.timeout_s={timeout_s!r}: use a number of seconds > 0 (or null: no limit)"
        )
    if rm.mp_context not in START_METHODS:
        problems.append(f"reward_model.mp_context={rm.mp_context!r}: use one of {list(START_METHODS)}")
    if rm.reward_manager != "dapo" and rm.overlong_buffer.enable:
        problems.append(
            "reward_model.overlong_buffer.enable=true needs reward_model.reward_manager=dapo "
            f"(got {rm.reward_manager!r})"
        )
    return problems
