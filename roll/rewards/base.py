"""The reward-function contract: ``(prompt, response, sample) -> float | RewardOutput``.

A reward function is a pure, fast Python function registered by name in ``REWARD_FUNCTIONS``:

    prompt:   the prompt text the policy saw.
    response: the generated text being scored.
    sample:   the dataset row the prompt came from (e.g. its ``answer``), as a dict.

It returns either a plain number (the sequence score) or a ``RewardOutput`` that can also carry
per-token rewards (process rewards) and logging info. Callers go through ``score_response``, which
validates the result and always returns a ``RewardOutput``. A reward that reads row fields declares them
with ``@needs_fields("answer")`` so that rows without them fail at load time. A reward registered with
``inline=True`` is a pure check cheaper than a call to a reward worker (``exact_match``): the controller
scores it itself (``roll.rewards.scoring.scored_in_controller``, docs/rewards.md).

A process reward, which scores the response token by token, also declares a ``response_ids`` parameter
(``fn(prompt, response, sample, response_ids)``): it then receives the response's token ids, the tokens
its ``token_rewards`` must line up with one to one. Their sum is the return the advantage estimators see
(``roll.pipelines.credit.token_level_rewards``), so ``score`` is best kept equal to that sum.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll.utils.registry import Registry, accepted_kwargs


@dataclass
class RewardOutput:
    """What a reward function says about one response.

    Attributes:
        score: the sequence-level reward.
        token_rewards: optional per-token rewards for the response tokens (process rewards), one per
            response token; their sum then takes the score's place in the return. ``None`` means the
            score is placed on the last response token.
        info: extra values to log (e.g. the parsed answer), keyed by name.
    """

    score: float
    token_rewards: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[str, str, dict], "float | RewardOutput"]


class RewardError(RuntimeError):
    """A reward function failed while the controller scored responses (``inline`` rewards); on a
    reward worker the same failure is a ``WorkerError`` naming the rank."""


REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


def score_response(
    name: str,
    prompt: str,
    response: str,
    sample: dict,
    response_ids: Sequence[int] | None = None,
    options: dict[str, Any] | None = None,
) -> RewardOutput:
    """Run the reward function registered as ``name`` and normalise its result.

    Args:
        name: ``REWARD_FUNCTIONS`` name.
        prompt: prompt text.
        response: generated text.
        sample: the dataset row.
        response_ids: the response's token ids (padding excluded), when known. Passed on only to a
            function that declares a ``response_ids`` parameter, so plain rewards keep their 3 arguments.
        options: keyword arguments for the function (its configured options, e.g. a timeout).

    Returns:
        A ``RewardOutput``; a plain number ``x`` becomes ``RewardOutput(score=float(x))``.

    Raises:
        KeyError: unknown reward name (with a did-you-mean suggestion).
        TypeError: the function returned something other than a number or a ``RewardOutput``.
        ValueError: ``token_rewards`` has not one entry per token of ``response_ids``.
    """
    return score_responses(name, [prompt], [response], [sample], [response_ids], options)[0]


def score_responses(
    name: str,
    prompts: Sequence[str],
    responses: Sequence[str],
    samples: Sequence[dict],
    response_ids: Sequence[Sequence[int] | None] | None = None,
    options: dict[str, Any] | None = None,
) -> list[RewardOutput]:
    """``score_response`` for many responses. A reward registered with ``batched=True`` takes the lists
    in one call and returns one result per response (a judge model then generates for all at once);
    any other is called response by response."""
    fn = REWARD_FUNCTIONS.get(name)
    ids = list(response_ids) if response_ids is not None else [None] * len(prompts)
    if REWARD_FUNCTIONS.traits(name).get("batched"):
        results = fn(list(prompts), list(responses), list(samples), **(options or {}))
        if not isinstance(results, Sequence) or len(results) != len(prompts):
            raise TypeError(
                f"batched reward function '{name}' ({_describe(fn)}) must return one result per response "
                f"({len(prompts)}), got {type(results).__name__}"
            )
    else:
        results = [
            fn(prompt, response, sample, **accepted_kwargs(fn, {"response_ids": row_ids}), **(options or {}))
            for prompt, response, sample, row_ids in zip(prompts, responses, samples, ids)
        ]
    return [_normalise(name, fn, result, row_ids) for result, row_ids in zip(results, ids)]


def _normalise(name: str, fn: RewardFn, result: object, response_ids: Sequence[int] | None) -> RewardOutput:
    if isinstance(result, RewardOutput):
        check_token_rewards(name, fn, result, response_ids)
        return result
    # bool is a number too, and True/False as 1/0 is a natural thing for a checker to return.
    if isinstance(result, numbers.Real):
        return RewardOutput(score=float(result))
    raise TypeError(
        f"reward function '{name}' ({_describe(fn)}) returned "
        f"{type(result).__name__} {result!r}; it must return a float or a RewardOutput"
    )


def check_token_rewards(
    name: str, fn: RewardFn, result: RewardOutput, response_ids: Sequence[int] | None
) -> None:
    """Raise ValueError when ``result.token_rewards`` cannot be laid on the tokens of ``response_ids``:
    a misaligned process reward would otherwise credit the wrong tokens, or fail later far from here."""
    if result.token_rewards is None or response_ids is None:
        return
    if len(result.token_rewards) != len(response_ids):
        raise ValueError(
            f"reward function '{name}' ({_describe(fn)}) returned {len(result.token_rewards)} token_rewards "
            f"for a response of {len(response_ids)} tokens; return one per response token "
            "(declare a `response_ids` parameter to receive them)"
        )


def _describe(fn: RewardFn) -> str:
    return str(getattr(fn, "__qualname__", fn))


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
