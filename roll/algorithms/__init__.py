"""Pure tensor functions for RL on LLMs: advantages, policy losses, KL estimators, loss aggregation,
reward shaping, group filters (dynamic sampling), preference losses (DPO and relatives) and distillation
divergences.

Each family is a registry, so the config selects an entry by name and a new one is a single function
plus ``@REGISTRY.register("name", **traits)``. Nothing here imports Ray or worker code.
"""

from roll.algorithms import turn_advantages  # noqa: F401  (registers gigpo and step_reinforce)
from roll.algorithms.advantages import ADVANTAGE_ESTIMATORS
from roll.algorithms.aggregation import LOSS_AGGREGATIONS, aggregation_count
from roll.algorithms.distillation import DISTILL_OBJECTIVES
from roll.algorithms.filters import GROUP_FILTERS, GroupOutcome, rejecting_filter
from roll.algorithms.kl import KL_ESTIMATORS
from roll.algorithms.losses import POLICY_LOSSES
from roll.algorithms.preference import PREFERENCE_LOSSES

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DISTILL_OBJECTIVES",
    "GROUP_FILTERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "GroupOutcome",
    "aggregation_count",
    "rejecting_filter",
]
