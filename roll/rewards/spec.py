"""A domain's reward: one registered function, or a weighted sum of several, optionally multiplied by
rules (e.g. a format check that zeroes a badly laid-out answer), each with its own options.

    score = (sum_i weight_i * reward_i) * prod_j multiplier_j

Pure: the reward workers build a ``RewardSpec`` per domain from the config and call ``score_with``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll.rewards.base import REWARD_FUNCTIONS, RewardOutput, score_responses
from roll.utils.registry import did_you_mean

# The positional contract of every reward; options are the other parameters.
_CONTRACT = ("prompt", "response", "sample", "response_ids", "prompts", "responses", "samples")


@dataclass(frozen=True)
class RewardSpec:
    """How one domain scores a response.

    Attributes:
        weights: reward name -> weight; the score is the weighted sum of their scores.
        multipliers: reward names whose scores multiply that sum (rules in [0, 1] used as gates).
        options: reward name -> keyword options passed to that reward function.
    """

    weights: dict[str, float]
    multipliers: tuple[str, ...] = ()
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def single(cls, name: str, options: Mapping[str, Any] | None = None) -> RewardSpec:
        return cls({name: 1.0}, options={name: dict(options)} if options else {})

    def names(self) -> list[str]:
        """Every reward the spec runs, weighted ones first."""
        return list(dict.fromkeys([*self.weights, *self.multipliers]))


def score_with(
    spec: RewardSpec, prompt: str, response: str, sample: dict, response_ids: Sequence[int] | None = None
) -> RewardOutput:
    """Score one response with ``spec`` (see ``score_all``)."""
    return score_all(spec, [prompt], [response], [sample], [response_ids])[0]


def score_all(
    spec: RewardSpec,
    prompts: Sequence[str],
    responses: Sequence[str],
    samples: Sequence[dict],
    response_ids: Sequence[Sequence[int] | None] | None = None,
) -> list[RewardOutput]:
    """Score responses with ``spec``, each reward over all of them at once (``score_responses``).

    ``info`` merges the rewards' counters (summed when two report the same key) and, with more than one
    reward, adds each one's score as ``<name>``. Per-token rewards (process rewards) pass through only
    from a spec of one reward with weight 1 and no multiplier: a weighted mix of token and sequence
    rewards has no single right token layout.

    Raises:
        ValueError: a reward returned ``token_rewards`` inside a combined spec.
    """
    names = spec.names()
    by_name = {
        name: score_responses(name, prompts, responses, samples, response_ids, spec.options.get(name))
        for name in names
    }
    return [_combine(spec, {name: by_name[name][row] for name in names}) for row in range(len(prompts))]


def _combine(spec: RewardSpec, outputs: dict[str, RewardOutput]) -> RewardOutput:
    names = list(outputs)
    info: dict[str, float] = {}
    for name, out in outputs.items():
        for key, value in out.info.items():
            if isinstance(value, (int, float)):
                info[key] = info.get(key, 0.0) + float(value)
        if len(names) > 1:
            info[name] = out.score
    if len(names) == 1 and spec.weights.get(names[0]) == 1.0:
        only = outputs[names[0]]
        return RewardOutput(only.score, only.token_rewards, info)
    with_tokens = [name for name, out in outputs.items() if out.token_rewards is not None]
    if with_tokens:
        raise ValueError(
            f"reward '{with_tokens[0]}' returns per-token rewards, which cannot be weighted or multiplied "
            "with other rewards; give it its own domain or use it alone with weight 1"
        )
    score = sum(weight * outputs[name].score for name, weight in spec.weights.items())
    for name in spec.multipliers:
        score *= outputs[name].score
    return RewardOutput(float(score), None, info)


def check_spec(key: str, spec: RewardSpec) -> list[str]:
    """Problems with ``spec`` found before any worker starts: unknown reward names, options a reward
    does not take (each with a suggestion), and option values that the reward's registered
    ``check_options(**options)`` rejects. ``key`` is the config key shown in the messages."""
    problems = []
    for name in spec.names():
        try:
            fn = REWARD_FUNCTIONS.get(name)
        except KeyError as e:
            problems.append(f"{key}: {e.args[0]}")
            continue
        accepted = reward_options(fn)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _parameters(fn))
        unknown = [o for o in spec.options.get(name, {}) if o not in accepted and not takes_any]
        for option in unknown:
            takes = ", ".join(accepted) or "no options"
            problems.append(
                f"{key}: reward '{name}' has no option '{option}'.{did_you_mean(option, accepted)} "
                f"It takes: {takes}"
            )
        # A reward registered with ``check_options`` vets its option values now (a regex compiles).
        check = REWARD_FUNCTIONS.traits(name).get("check_options")
        if check is not None and not unknown:
            try:
                check(**spec.options.get(name, {}))
            except (TypeError, ValueError) as e:
                problems.append(f"{key}: {e}")
    for name in spec.options:
        if name not in spec.names():
            problems.append(
                f"{key}: options are given for reward '{name}', which this domain does not use "
                f"(it uses {', '.join(spec.names())})"
            )
    return problems


def reward_options(fn: Any) -> list[str]:
    """The option names a reward function takes: its parameters beyond the reward contract."""
    return [
        p.name
        for p in _parameters(fn)
        if p.name not in _CONTRACT
        and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def _parameters(fn: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def domain_specs(domain: Any) -> tuple[RewardSpec, RewardSpec]:
    """The training and evaluation ``RewardSpec`` of a domain config (``roll.config.rlvr.DomainConfig``):
    its ``reward`` or weighted ``rewards``, ``reward_multipliers`` and ``reward_options``; evaluation
    uses ``eval_reward`` alone when set (with its options, if any)."""
    weights = dict(domain.rewards) if domain.rewards else {domain.reward: 1.0}
    options = {name: dict(opts) for name, opts in domain.reward_options.items()}
    train = RewardSpec(weights, tuple(domain.reward_multipliers), options)
    if domain.eval_reward is None:
        return train, train
    return train, RewardSpec.single(domain.eval_reward, options.get(domain.eval_reward))
