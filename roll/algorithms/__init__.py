"""Pure tensor functions for RL on LLMs: advantages, policy losses, KL estimators, loss aggregation,
reward shaping.

Each family is a registry, so the config selects an entry by name and a new one is a single function
plus ``@REGISTRY.register("name", **traits)``. Nothing here imports Ray or worker code.
"""

from roll.algorithms.advantages import ADVANTAGE_ESTIMATORS
from roll.algorithms.aggregation import LOSS_AGGREGATIONS, aggregation_count
from roll.algorithms.kl import KL_ESTIMATORS
from roll.algorithms.losses import POLICY_LOSSES

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "aggregation_count"]
