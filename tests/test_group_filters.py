"""Group filters for dynamic sampling (roll/algorithms/filters.py): which groups are kept, in what
order filters are asked, and user-registered filters."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from roll.algorithms import GROUP_FILTERS, GroupOutcome, rejecting_filter


def outcome(scores: Sequence[float], finish_reasons: Sequence[str] | None = None) -> GroupOutcome:
    """A group of ``len(scores)`` samples, each 3 tokens long, finished with "stop" unless told."""
    n = len(scores)
    return GroupOutcome(
        scores=torch.tensor(scores, dtype=torch.float32),
        response_lengths=torch.full((n,), 3, dtype=torch.long),
        finish_reasons=tuple(finish_reasons or ["stop"] * n),
        sample={"prompt": "1+1=", "answer": "2"},
    )


def test_builtin_filters_are_registered():
    assert {"equal_rewards", "truncated"} <= set(GROUP_FILTERS.names())


@pytest.mark.parametrize(
    ("scores", "kept"),
    [
        ([1.0, 1.0, 1.0, 1.0], False),  # all correct: zero advantages
        ([0.0, 0.0], False),  # all wrong
        ([0.5], False),  # a group of one is always uniform
        ([], False),  # nothing to learn from
        ([1.0, 0.0, 1.0, 1.0], True),
        ([0.25, 0.25, 0.2500001], True),  # any difference is a signal
    ],
)
def test_equal_rewards_drops_groups_without_signal(scores, kept):
    assert GROUP_FILTERS.get("equal_rewards")(outcome(scores)) is kept


@pytest.mark.parametrize(
    ("reasons", "kept"),
    [
        (["stop", "stop", "stop"], True),
        (["stop", "length", "stop"], False),
        (["length", "length", "length"], False),
        (["stop", "abort", "stop"], True),  # only truncation counts
    ],
)
def test_truncated_drops_groups_with_a_response_at_max_new_tokens(reasons, kept):
    assert GROUP_FILTERS.get("truncated")(outcome([1.0, 0.0, 1.0], reasons)) is kept


def test_rejecting_filter_names_the_first_filter_that_drops_in_the_order_given():
    uniform_and_truncated = outcome([1.0, 1.0], ["length", "stop"])
    assert rejecting_filter(["equal_rewards", "truncated"], uniform_and_truncated) == "equal_rewards"
    assert rejecting_filter(["truncated", "equal_rewards"], uniform_and_truncated) == "truncated"
    assert rejecting_filter(["truncated", "equal_rewards"], outcome([1.0, 1.0])) == "equal_rewards"


def test_rejecting_filter_is_none_when_every_filter_keeps_the_group():
    assert rejecting_filter(["equal_rewards", "truncated"], outcome([1.0, 0.0])) is None
    assert rejecting_filter([], outcome([1.0, 1.0], ["length", "length"])) is None


def test_rejecting_filter_rejects_unknown_names_with_a_suggestion():
    with pytest.raises(KeyError, match="unknown group filter 'equal_reward'.*Did you mean 'equal_rewards'"):
        rejecting_filter(["equal_reward"], outcome([1.0, 0.0]))


def test_a_user_registered_filter_is_used_by_name(monkeypatch):
    # A copy of the registry's entries, so other tests never see the test filter.
    monkeypatch.setattr(GROUP_FILTERS, "_entries", dict(GROUP_FILTERS._entries))
    monkeypatch.setattr(GROUP_FILTERS, "_traits", dict(GROUP_FILTERS._traits))

    @GROUP_FILTERS.register("some_correct")
    def some_correct(group: GroupOutcome) -> bool:
        return bool((group.scores > 0).any())

    assert rejecting_filter(["equal_rewards", "some_correct"], outcome([0.0, 0.0])) == "equal_rewards"
    assert rejecting_filter(["some_correct"], outcome([0.0, 0.0])) == "some_correct"
    assert rejecting_filter(["some_correct"], outcome([0.0, 1.0])) is None


def test_group_outcome_is_frozen():
    group = outcome([1.0, 0.0])
    with pytest.raises(AttributeError):
        group.scores = torch.zeros(2)  # type: ignore[misc]
