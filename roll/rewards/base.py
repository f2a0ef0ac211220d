"""The reward-function contract: ``(prompt, response, sample) -> float | RewardOutput``.

A reward function is a pure, fast Python function registered by name in ``REWARD_FUNCTIONS``:

    prompt:   the prompt text the policy saw.
    response: the generated text being scored.
    sample:   the dataset row the prompt came from (e.g. its ``answer``), as a dict.

It returns either a plain number (the sequence score) or a ``RewardOutput`` that can also carry
per-token rewards and logging info. Callers go through ``score_response``, which validates the result
and always returns a ``RewardOutput``. A reward that reads row fields declares them with
``@needs_fields("answer")`` so that rows without them fail at load time.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from roll.utils.registry import Registry


@dataclass
class RewardOutput:
    """What a reward function says about one response.

    Attributes:
        score: the sequence-level reward.
        token_rewards: optional per-token rewards for the response tokens (process rewards); ``None``
            means the score is placed on the last response token.
        info: extra values to log (e.g. the parsed answer), keyed by name.
    """

    score: float
    token_rewards: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[str, str, dict], "float | RewardOutput"]

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


def score_response(name: str, prompt: str, response: str, sample: dict) -> RewardOutput:
    """Run the reward function registered as ``name`` and normalise its result.

    Args:
        name: ``REWARD_FUNCTIONS`` name.
        prompt: prompt text.
        response: generated text.
        sample: the dataset row.

    Returns:
        A ``RewardOutput``; a plain number ``x`` becomes ``RewardOutput(score=float(x))``.

    Raises:
        KeyError: unknown reward name (with a did-you-mean suggestion).
        TypeError: the function returned something other than a number or a ``RewardOutput``.
    """
    fn = REWARD_FUNCTIONS.get(name)
    result = fn(prompt, response, sample)
    if isinstance(result, RewardOutput):
        return result
    # bool is a number too, and True/False as 1/0 is a natural thing for a checker to return.
    if isinstance(result, numbers.Real):
        return RewardOutput(score=float(result))
    raise TypeError(
        f"reward function '{name}' ({getattr(fn, '__qualname__', fn)}) returned "
        f"{type(result).__name__} {result!r}; it must return a float or a RewardOutput"
    )


def needs_fields(*fields: str) -> Callable[[RewardFn], RewardFn]:
    """Declare the dataset-row fields a reward reads, so rows lacking them are rejected when the
    dataset loads (naming file and line), not when the first response is scored on a worker."""

    def decorator(fn: RewardFn) -> RewardFn:
        fn.required_fields = tuple(fields)  # type: ignore[attr-defined]
        return fn

    return decorator


def required_fields(*names: str) -> tuple[str, ...]:
    """Row fields that the rewards registered as ``names`` declared with ``needs_fields``."""
    fields: list[str] = []
    for name in names:
        for f in getattr(REWARD_FUNCTIONS.get(name), "required_fields", ()):
            if f not in fields:
                fields.append(f)
    return tuple(fields)
