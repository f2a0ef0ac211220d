"""Multi-turn environments behind a text protocol (``roll.envs.base``): no Ray, no tokens.

Importing this package registers the built-in environments: ``frozen_lake``, ``sokoban``, ``tool_use``
and ``gymnasium`` (any Gymnasium env with discrete actions that renders as text).
"""

from roll.envs import frozen_lake, gym_adapter, sokoban, tool_use  # noqa: F401  (register the built-in environments)
from roll.envs.base import ENVIRONMENTS, TextEnv, check_env, make_env

__all__ = ["ENVIRONMENTS", "TextEnv", "check_env", "make_env"]
