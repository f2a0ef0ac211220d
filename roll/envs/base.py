"""The environment contract: text in, text out, no tokens and no Ray.

An environment is a class registered by name in ``ENVIRONMENTS``; its constructor's keyword arguments are
its options (``env.options`` in a config), checked when the config loads (``check_env``):

    reset(seed) -> (observation, info)
    step(action_text) -> (observation, reward, terminated, truncated, info)

``seed`` fixes everything random about the episode (a FrozenLake map, its slips), so a seed is a task:
the held-out seeds are a set of tasks training never sees (``roll.envs.seeds``). ``action_text`` is the
policy's whole turn, decoded; the environment parses it. A turn it cannot parse is not an error: the
step returns ``info["action_is_valid"] = False``, the env's ``invalid_action_reward`` and an observation
that says what was expected, and the episode goes on (the format penalty). ``info["metrics"]`` holds the
env's own numbers for the step (e.g. ``success``), averaged per episode by whoever runs it.

An observation is text, or an ``ImageObservation`` (``FrozenLake(render="image")``): pictures and text for
a vision-language policy, with the env's text rendering of the same state beside them (``state``: what an
expert reads and GiGPO compares, never shown to the policy).

``layout(seed)`` names the task a seed makes (a map, as text), or None when seeds never repeat a task:
training seeds whose layout is a held-out one are skipped, so a held-out task is never trained on.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from roll.utils.registry import Registry, did_you_mean


@dataclass(frozen=True)
class ImageObservation:
    """An observation with pictures: ``images`` (encoded PNG or JPEG) then ``text`` are what the policy
    reads; ``state`` renders the same state as text for experts and anchor states (not shown)."""

    text: str
    images: tuple[bytes, ...]
    state: str


Observation = str | ImageObservation
StepResult = tuple[Observation, float, bool, bool, dict[str, Any]]


class TextEnv(abc.ABC):
    """One environment instance; ``reset`` starts an episode, ``step`` plays one turn of it."""

    @abc.abstractmethod
    def reset(self, seed: int) -> tuple[Observation, dict[str, Any]]:
        """Start the episode of ``seed`` (deterministic: the same seed gives the same episode)."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Play the policy's turn ``action_text``: (observation, reward, terminated, truncated, info)."""

    def layout(self, seed: int) -> Hashable | None:
        """The task ``seed`` makes, comparable between seeds (None: every seed is its own task)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the instance holds."""


ENVIRONMENTS: Registry[type[TextEnv]] = Registry("environment")


def env_options(cls: type[TextEnv]) -> list[str]:
    """The option names an environment takes: its constructor's keyword parameters."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_env(key: str, name: str, options: dict[str, Any]) -> list[str]:
    """Problems with an environment's name and options, found when the config loads: an unknown name or
    option (with a suggestion), and values the env's registered ``check_options(**options)`` rejects.
    ``key`` is the config key shown in the messages."""
    try:
        cls = ENVIRONMENTS.get(name)
    except KeyError as e:
        return [f"{key}: {e.args[0]}"]
    accepted = env_options(cls)
    unknown = [option for option in options if option not in accepted]
    problems = [
        f"{key}: environment '{name}' has no option '{option}'.{did_you_mean(option, accepted)} "
        f"It takes: {', '.join(accepted) or 'no options'}"
        for option in unknown
    ]
    check = ENVIRONMENTS.traits(name).get("check_options")
    if check is not None and not unknown:
        try:
            check(**options)
        except (TypeError, ValueError) as e:
            problems.append(f"{key}: {e}")
    return problems


def observed_state(observation: Observation) -> str:
    """The state an observation shows, as text (an image observation's ``state``)."""
    return observation.state if isinstance(observation, ImageObservation) else observation


def invalid_action(action_help: str, observation: Observation, reward: float) -> StepResult:
    """The step result of a turn the env cannot parse (the format penalty): ``reward``, an observation
    that says what a valid turn looks like above the unchanged ``observation``, and the episode goes on."""
    said = f"Invalid action. {action_help}"
    if isinstance(observation, ImageObservation):
        shown: Observation = ImageObservation(
            f"{said}\n{observation.text}".rstrip("\n"), observation.images, observation.state
        )
    else:
        shown = f"{said}\n{observation}"
    return (
        shown,
        reward,
        False,
        False,
        {"action_is_valid": False, "metrics": {}},
    )


def make_env(name: str, options: dict[str, Any] | None = None) -> TextEnv:
    """A new instance of the environment registered as ``name`` with ``options``."""
    return ENVIRONMENTS.get(name)(**(options or {}))
