"""Name -> function registries for advantage estimators and policy losses.

The trainer only ever looks functions up by the string found in its config, so a new algorithm is a
decorated function in any imported module (or a file named by ``load_function``) and no trainer edit.
An estimator declares what it needs (`EstimatorTraits`) in the same decorator. Importing this module
imports the package ``fusedrl.algorithms`` first, whose ``__init__`` registers the built-ins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fusedrl import plugins

F = TypeVar("F", bound=Callable[..., Any])

ADV_ESTIMATOR_KEY = "algorithm.adv_estimator"
POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"

_ADV_ESTIMATORS: dict[str, Callable[..., Any]] = {}
_POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimatorTraits:
    """What an advantage estimator needs from the run, declared where it is registered.

    The role set (`fusedrl.config.needed_roles`), validation and the trainer read these; nothing compares
    estimator names. A new estimator with a new need adds a field here and reads it where it is used.
    """

    needs_critic: bool = False
    """Values from a critic role (GAE): the workers build one and the trainer updates it."""
    needs_greedy_baseline: bool = False
    """One greedy response per prompt, scored, as every sample's baseline (ReMax)."""
    min_group_size: int = 1
    """Smallest ``rollout.n`` that gives non-zero advantages (group-relative estimators compare samples)."""
    needs_sum_pi_squared: bool = False
    """``old_log_probs`` and Σπ² per token from the actor's old-log-prob pass (the optimal token baseline):
    the pass always runs (never folded into the update) and returns Σπ² too."""
    needs_reward_components: bool = False
    """Each row's named reward components (``algorithm.gdpo_reward_keys``, entries of a dict-returning
    scorer) as ``reward_components`` ``[B, K]``, and ``algorithm.gdpo_reward_weights`` as ``reward_weights``."""


_ADV_TRAITS: dict[str, EstimatorTraits] = {}


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    # A module imported twice (e.g. reloaded in a notebook) re-registers an equivalent function;
    # that must not count as a clash, while two different functions under one name must.
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        existing = table.get(name)
        if existing is not None and not _same_function(existing, fn):
            raise ValueError(
                f"{kind} {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pick another name"
            )
        table[name] = fn
        return fn

    return decorator


def register_adv_estimator(
    name: str,
    *,
    needs_critic: bool = False,
    needs_greedy_baseline: bool = False,
    min_group_size: int = 1,
    needs_sum_pi_squared: bool = False,
    needs_reward_components: bool = False,
) -> Callable[[F], F]:
    """Decorator registering a function as the advantage estimator called ``name``, with its needs.

    No paper: registry plumbing. The function must take
    ``(token_level_rewards [B, T], response_mask [B, T], index, **kwargs)`` and return
    ``(advantages [B, T], returns [B, T])``. The keyword arguments are its `EstimatorTraits`.
    Registering a different function under a taken name raises ValueError.
    """
    traits = EstimatorTraits(
        needs_critic=needs_critic,
        needs_greedy_baseline=needs_greedy_baseline,
        min_group_size=min_group_size,
        needs_sum_pi_squared=needs_sum_pi_squared,
        needs_reward_components=needs_reward_components,
    )
    register = _register(_ADV_ESTIMATORS, "advantage estimator", name)

    def decorator(fn: F) -> F:
        register(fn)
        _ADV_TRAITS[name] = traits
        return fn

    return decorator


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator registering a function as the policy loss called ``name``.

    No paper: registry plumbing. The function must take
    ``(log_prob, old_log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, loss_agg_mode, global_norm)`` and return ``(loss scalar, metrics dict)``.
    A loss whose paper fixes the aggregation of its own term sets ``fn.agg_mode``: the actor then passes
    that mode's ``global_norm`` for the policy term, while the entropy and KL terms keep
    ``loss_agg_mode`` (verl's rule). Registering a different function under a taken name raises ValueError.
    """
    return _register(_POLICY_LOSSES, "policy loss", name)


def _lookup(
    table: dict[str, Callable[..., Any]], name: str, kind: str, key: str, decorator: str
) -> Callable[..., Any]:
    fn = table.get(name)
    if fn is None:
        known = ", ".join(sorted(table)) or "<none>"
        raise ValueError(
            f"Unknown {kind} {name!r} (config key `{key}`). Known: {known}. "
            f"Register a new one with @{decorator}(name) in an imported module."
        )
    return fn


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """Return the advantage estimator registered as ``name``; ValueError naming the config key if unknown.

    No paper: registry plumbing.
    """
    return _lookup(_ADV_ESTIMATORS, name, "advantage estimator", ADV_ESTIMATOR_KEY, "register_adv_estimator")


def get_adv_traits(name: str) -> EstimatorTraits:
    """The `EstimatorTraits` the estimator ``name`` was registered with; ValueError if unknown.

    No paper: registry plumbing.
    """
    get_adv_estimator(name)  # the error for an unknown name
    return _ADV_TRAITS[name]


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Return the policy loss registered as ``name``; ValueError naming the config key if unknown.

    No paper: registry plumbing.
    """
    return _lookup(_POLICY_LOSSES, name, "policy loss", POLICY_LOSS_KEY, "register_policy_loss")


def roles_for(adv_estimator: str, *, use_kl: bool, reward_model: bool) -> dict[str, bool]:
    """The optional roles a run builds: the reference for a KL term (loss or reward), the critic when the
    estimator's traits ask for one (an unknown estimator, reported by the config check, needs none), the
    reward model when enabled. No paper: registry plumbing."""
    critic = adv_estimator in _ADV_ESTIMATORS and _ADV_TRAITS[adv_estimator].needs_critic
    return {"ref": bool(use_kl), "critic": critic, "reward_model": bool(reward_model)}


def list_adv_estimators() -> list[str]:
    """Sorted names of all registered advantage estimators. No paper: registry plumbing."""
    return sorted(_ADV_ESTIMATORS)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses. No paper: registry plumbing."""
    return sorted(_POLICY_LOSSES)


def load_function(dotted: str) -> Callable[..., Any]:
    """Import and return the callable named by ``dotted``.

    No paper: plumbing for user-supplied reward / advantage / loss functions named in a config.
    Accepted forms: ``pkg.mod:func``, ``pkg.mod.func`` and ``/path/to/file.py:func`` (a relative
    ``file.py:func`` is resolved against the current directory). Errors name the path that failed.
    See `fusedrl.plugins` (the one loader for user code).
    """
    return plugins.load_function(dotted)
