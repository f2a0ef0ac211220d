"""Group filters: decide whether a prompt's group of samples is worth training on.

With dynamic sampling (DAPO), the rollout scheduler generates ``num_return_sequences`` samples per
prompt, scores them, and asks every configured filter (``rollout.group_filters``) about the group. A
group that any filter drops is discarded and another prompt is sampled in its place, so the training
batch is filled with groups that carry a learning signal.

Every filter has the same signature, so the config selects filters by name::

    fn(outcome: GroupOutcome) -> bool   # True keeps the group

Built-in filters:

- ``equal_rewards``: drops a group whose scores are all equal. Group baselines (GRPO, RLOO, ...) give
  every sample of such a group a zero advantage, so it would cost compute and teach nothing (DAPO's
  dynamic sampling).
- ``truncated``: drops a group in which any response hit ``max_new_tokens`` (finish reason
  ``"length"``): its score rates an unfinished answer.

Add your own in a module listed under the config's ``imports:`` (imported by the driver and every
worker, so the name is known when the config is validated)::

    from roll.algorithms.filters import GROUP_FILTERS, GroupOutcome

    @GROUP_FILTERS.register("some_correct")
    def some_correct(outcome: GroupOutcome) -> bool:
        return bool((outcome.scores > 0).any())

and set ``rollout.group_filters: [equal_rewards, some_correct]``. Filters are pure: no Ray, no workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from roll.utils.registry import Registry


@dataclass(frozen=True)
class GroupOutcome:
    """What a prompt's group of samples came to, as a group filter sees it.

    Attributes:
        scores: ``[n]`` float32 sequence scores (before reward shaping).
        response_lengths: ``[n]`` long, tokens per response.
        finish_reasons: ``n`` strings, ``"stop" | "length" | "abort"`` per sample.
        sample: the dataset row of the prompt.
    """

    scores: torch.Tensor
    response_lengths: torch.Tensor
    finish_reasons: tuple[str, ...]
    sample: dict


GroupFilter = Callable[[GroupOutcome], bool]
GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter")


@GROUP_FILTERS.register("equal_rewards")
def keep_unequal_rewards(outcome: GroupOutcome) -> bool:
    """Keep the group unless all its scores are equal (then every group-relative advantage is 0).

    Exact equality on purpose: any difference, however small, is a signal that GRPO's std division
    scales up. An empty group is dropped too.
    """
    scores = outcome.scores
    return scores.numel() > 0 and bool((scores != scores[0]).any())


@GROUP_FILTERS.register("truncated")
def keep_untruncated(outcome: GroupOutcome) -> bool:
    """Keep the group unless a response stopped at ``max_new_tokens`` (finish reason ``"length"``)."""
    return "length" not in outcome.finish_reasons


def rejecting_filter(names: Sequence[str], outcome: GroupOutcome) -> str | None:
    """The first of ``names`` (in the order given) whose filter drops the group; None when all keep it.

    Args:
        names: ``GROUP_FILTERS`` names, e.g. ``rollout.group_filters``.
        outcome: the group.

    Raises:
        KeyError: an unknown filter name (with a did-you-mean suggestion).
    """
    for name in names:
        if not GROUP_FILTERS.get(name)(outcome):
            return name
    return None
