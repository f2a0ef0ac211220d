"""Pure reward functions, registered by name: ``(prompt, response, sample) -> float | RewardOutput``.

Importing this package registers the built-in rewards. Nothing here imports Ray or worker code.
"""

from roll.rewards import code, countdown, judge, match, math, rules  # noqa: F401  (register the built-in rewards)
from roll.rewards.base import REWARD_FUNCTIONS, RewardOutput, needs_fields, required_fields, score_response

__all__ = ["REWARD_FUNCTIONS", "RewardOutput", "needs_fields", "required_fields", "score_response"]
