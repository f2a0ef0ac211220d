"""Any Gymnasium environment with discrete actions as a ``TextEnv``, given a text renderer and an action
parser. FrozenLake (``roll.envs.frozen_lake``) is one; ``gymnasium`` (registered below) serves any env
that renders itself as text (``render_mode="ansi"``: Taxi, CliffWalking, ...) with actions named in the
config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from roll.envs.base import ENVIRONMENTS, Observation, StepResult, TextEnv, invalid_action

DEFAULT_INVALID_ACTION_REWARD = -0.1


class GymnasiumTextEnv(TextEnv):
    """A Gymnasium env behind the text protocol.

    Args:
        make: builds the Gymnasium env for a seed (an env whose layout depends on the seed, such as a
            random map, is built anew each episode; others may return the same instance).
        render: the observation as text, from the env and its last observation.
        parse_action: the action index of a turn's text, or None when the text names no action.
        action_help: what a valid turn looks like, said in the observation after an invalid one.
        invalid_action_reward: the reward of a turn that names no action (the format penalty).
    """

    def __init__(
        self,
        make: Callable[[int], Any],
        render: Callable[[Any, Any], str],
        parse_action: Callable[[str], int | None],
        action_help: str,
        invalid_action_reward: float = DEFAULT_INVALID_ACTION_REWARD,
    ):
        self.make, self.render, self.parse_action = make, render, parse_action
        self.action_help = action_help
        self.invalid_action_reward = invalid_action_reward
        self.env: Any = None
        self._last: Any = None

    def reset(self, seed: int) -> tuple[Observation, dict[str, Any]]:
        import gymnasium

        env = self.make(seed)
        if not isinstance(env.action_space, gymnasium.spaces.Discrete):
            raise TypeError(
                f"the Gymnasium adapter takes envs with discrete actions; {env.spec.id if env.spec else env} "
                f"has {env.action_space}"
            )
        if self.env is not None and self.env is not env:
            self.env.close()
        self.env = env
        self._last, info = env.reset(seed=seed)
        return self.render(env, self._last), {"gym_info": info}

    def step(self, action_text: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("step() before reset()")
        action = self.parse_action(action_text)
        if action is None or not self.env.action_space.contains(action):
            rendered = self.render(self.env, self._last)
            return invalid_action(self.action_help, rendered, self.invalid_action_reward)
        self._last, reward, terminated, truncated, info = self.env.step(action)
        return (
            self.render(self.env, self._last),
            float(reward),
            bool(terminated),
            bool(truncated),
            {"action_is_valid": True, "metrics": {}, "gym_info": info},
        )

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def action_parser(names: Sequence[str]) -> Callable[[str], int | None]:
    """A parser that reads a turn as one of ``names`` (case and surrounding whitespace ignored): the
    action's index, or None."""
    index = {name.strip().lower(): i for i, name in enumerate(names)}

    def parse(text: str) -> int | None:
        return index.get(text.strip().lower())

    return parse


def _check_gymnasium_options(env_id: str, actions: Sequence[str], **_: object) -> None:
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"environment 'gymnasium' needs an env_id such as 'CliffWalking-v1', got {env_id!r}")
    names = [str(a).strip().lower() for a in actions]
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"environment 'gymnasium': actions must be distinct non-empty names, got {list(actions)}"
        )


@ENVIRONMENTS.register("gymnasium", check_options=_check_gymnasium_options)
class GymnasiumEnv(GymnasiumTextEnv):
    """Any registered Gymnasium env with discrete actions that renders as text (``render_mode="ansi"``).

    Args:
        env_id: the Gymnasium id, e.g. ``CliffWalking-v1`` or ``Taxi-v3``.
        actions: one name per discrete action, in the env's order (``[up, right, down, left]`` for
            CliffWalking); a turn is one of them.
        make_kwargs: keyword arguments for ``gymnasium.make``.
        invalid_action_reward: the reward of a turn that names no action.
    """

    def __init__(
        self,
        env_id: str,
        actions: Sequence[str],
        make_kwargs: dict[str, Any] | None = None,
        invalid_action_reward: float = DEFAULT_INVALID_ACTION_REWARD,
    ):
        import gymnasium

        _check_gymnasium_options(env_id, actions)
        modes = _render_modes(env_id)
        if "ansi" not in modes:
            raise ValueError(
                f"environment 'gymnasium': {env_id} does not render as text (its render modes: "
                f"{', '.join(modes) or 'none'}); subclass GymnasiumTextEnv with a renderer of your own"
            )
        env = gymnasium.make(env_id, render_mode="ansi", **(make_kwargs or {}))
        if isinstance(env.action_space, gymnasium.spaces.Discrete) and env.action_space.n != len(actions):
            raise ValueError(
                f"environment 'gymnasium': {env_id} has {env.action_space.n} actions, but {len(actions)} "
                f"names were given ({list(actions)})"
            )
        super().__init__(
            make=lambda seed: env,
            render=lambda e, _: str(e.render()).rstrip("\n"),
            parse_action=action_parser(actions),
            action_help=f"Answer with one of: {', '.join(actions)}.",
            invalid_action_reward=invalid_action_reward,
        )


def _render_modes(env_id: str) -> list[str]:
    """The render modes an env declares (its class's ``metadata``), without building it."""
    import gymnasium

    entry = gymnasium.spec(env_id).entry_point
    if callable(entry):
        cls = entry
    else:
        import importlib

        module, name = entry.split(":")
        cls = getattr(importlib.import_module(module), name)
    return list(getattr(cls, "metadata", {}).get("render_modes", []))
