"""RL algorithm math: advantage estimators, policy losses, KL estimators, loss aggregation.

Pure torch functions with no engine imports; importing this package registers the built-ins.
"""

from fusedrl.algorithms import advantages, cov_losses, kl, losses, more_losses, token_baseline  # noqa: F401  (import registers the built-ins)
from fusedrl.algorithms.advantages import discounted_returns
from fusedrl.algorithms.kl import entropy_from_logits, kl_penalty
from fusedrl.algorithms.losses import agg_denominator, agg_loss
from fusedrl.algorithms.registry import (
    EstimatorTraits,
    get_adv_estimator,
    get_adv_traits,
    get_policy_loss,
    list_adv_estimators,
    list_policy_losses,
    load_function,
    register_adv_estimator,
    register_policy_loss,
)
from fusedrl.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten
from fusedrl.algorithms.value import value_loss

__all__ = [
    "EstimatorTraits",
    "agg_denominator",
    "agg_loss",
    "discounted_returns",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_adv_traits",
    "get_policy_loss",
    "kl_penalty",
    "list_adv_estimators",
    "list_policy_losses",
    "load_function",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
    "value_loss",
]
