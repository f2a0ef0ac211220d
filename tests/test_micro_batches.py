"""Micro-batch partitioning (roll.data.micro_batches): token budgets, balanced and fixed splits, and
trimming the left prompt padding a micro-batch does not need. Pure functions: no Ray, no model."""

from __future__ import annotations

import random

import pytest
import torch

from roll.data.batch import Batch
from roll.data.micro_batches import (
    balanced_split,
    count_for_budget,
    fixed_split,
    row_tokens,
    trim_prompt_padding,
)


def assert_partition(groups: list[list[int]], rows: int) -> None:
    """Contiguous, non-empty groups that together list every row once, in order."""
    assert all(groups), groups
    assert [i for group in groups for i in group] == list(range(rows))
    for group in groups:
        assert group == list(range(group[0], group[-1] + 1))


def group_sums(token_counts: list[int], groups: list[list[int]]) -> list[int]:
    return [sum(token_counts[i] for i in group) for group in groups]


# --------------------------------------------------------------------------- count_for_budget


@pytest.mark.parametrize(
    ("tokens", "budget", "expected"),
    [
        ([], 10, 0),
        ([3], 10, 1),
        ([5, 5], 10, 1),  # exactly the budget fits
        ([5, 5, 1], 10, 2),
        ([4, 4, 4, 4], 8, 2),
        ([4, 4, 4, 4], 7, 4),
        ([1] * 10, 3, 4),
        ([0, 0, 0], 1, 1),
        ([9, 2, 9], 10, 3),  # greedy, in order: rows are never reordered
    ],
)
def test_count_for_budget_packs_in_order(tokens: list[int], budget: int, expected: int) -> None:
    assert count_for_budget(tokens, budget) == expected


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [([25], 1), ([5, 25, 5], 3), ([25, 25], 2), ([2, 3, 25, 2, 3], 3)],
)
def test_row_over_budget_gets_a_micro_batch_of_its_own(tokens: list[int], expected: int) -> None:
    assert count_for_budget(tokens, 10) == expected


@pytest.mark.parametrize("budget", [0, -1])
def test_count_for_budget_rejects_nonpositive_budget(budget: int) -> None:
    with pytest.raises(ValueError, match=f"max_tokens must be positive \\(got {budget}\\)"):
        count_for_budget([1, 2], budget)


# --------------------------------------------------------------------------- balanced_split


@pytest.mark.parametrize(
    ("tokens", "parts"),
    [
        ([10] * 8, 4),
        ([1, 1, 1, 1, 100], 2),
        ([100, 1, 1, 1, 1], 2),
        ([1, 1, 1, 1, 1, 1, 1, 10], 4),
        ([0, 0, 0, 0], 3),
        ([5, 3, 8, 1, 9, 2, 7], 3),
        ([7], 1),
    ],
)
def test_balanced_split_makes_exactly_k_contiguous_groups(tokens: list[int], parts: int) -> None:
    groups = balanced_split(tokens, parts)
    assert len(groups) == parts
    assert_partition(groups, len(tokens))


def test_balanced_split_equal_rows_split_evenly() -> None:
    assert balanced_split([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert balanced_split([1] * 6, 3) == [[0, 1], [2, 3], [4, 5]]


def test_balanced_split_balances_by_tokens_not_rows() -> None:
    tokens = [1, 1, 1, 1, 1, 1, 6]
    groups = balanced_split(tokens, 2)
    assert groups == [[0, 1, 2, 3, 4, 5], [6]]
    assert group_sums(tokens, groups) == [6, 6]


def test_balanced_split_big_rows_first_or_last() -> None:
    assert balanced_split([100, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    assert balanced_split([1, 1, 1, 1, 100], 2) == [[0, 1, 2, 3], [4]]


def test_balanced_split_sums_are_roughly_balanced() -> None:
    rng = random.Random(0)
    for _ in range(500):
        rows = rng.randint(1, 40)
        parts = rng.randint(1, rows)
        tokens = [rng.choice([0, 1, 3, rng.randint(0, 200)]) for _ in range(rows)]
        groups = balanced_split(tokens, parts)
        assert len(groups) == parts
        assert_partition(groups, rows)
        # No group exceeds its fair share by more than one row: the split cannot do better in general.
        assert max(group_sums(tokens, groups)) <= sum(tokens) / parts + max(tokens)


@pytest.mark.parametrize("parts", [3, 4, 100])
def test_balanced_split_more_parts_than_rows_gives_one_row_each(parts: int) -> None:
    assert balanced_split([5, 1, 7], parts) == [[0], [1], [2]]


def test_balanced_split_one_part_is_everything() -> None:
    assert balanced_split([3, 1, 4, 1, 5], 1) == [[0, 1, 2, 3, 4]]


def test_balanced_split_after_count_for_budget() -> None:
    # The trainer's use: as many groups as the budget needs, then balanced.
    tokens = [6, 2, 2, 6, 2, 2]
    count = count_for_budget(tokens, 10)
    groups = balanced_split(tokens, count)
    assert len(groups) == count == 2
    assert_partition(groups, len(tokens))
    assert group_sums(tokens, groups) == [10, 10]


# --------------------------------------------------------------------------- fixed_split


@pytest.mark.parametrize(
    ("rows", "size", "expected"),
    [
        (6, 2, [[0, 1], [2, 3], [4, 5]]),
        (5, 2, [[0, 1], [2, 3], [4]]),
        (3, 8, [[0, 1, 2]]),
        (4, 1, [[0], [1], [2], [3]]),
        (0, 4, []),
    ],
)
def test_fixed_split(rows: int, size: int, expected: list[list[int]]) -> None:
    assert fixed_split(rows, size) == expected


# --------------------------------------------------------------------------- row_tokens


def make_batch(prompt_mask: list[list[int]], response_mask: list[list[int]]) -> Batch:
    pm = torch.tensor(prompt_mask)
    rm = torch.tensor(response_mask)
    rows = pm.shape[0]
    return Batch(
        tensors={
            "prompt_ids": torch.arange(pm.numel()).reshape(pm.shape) + 100,
            "prompt_mask": pm,
            "response_ids": torch.arange(rm.numel()).reshape(rm.shape) + 500,
            "response_mask": rm,
            "scores": torch.arange(rows, dtype=torch.float32),
        },
        non_tensors={"prompt_text": [f"p{i}" for i in range(rows)]},
        meta={"step": 3},
    )


def test_row_tokens_counts_real_prompt_and_response_tokens() -> None:
    batch = make_batch(
        [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]],
        [[1, 1, 0], [1, 0, 0], [1, 1, 1]],
    )
    assert row_tokens(batch) == [4, 4, 7]
    assert all(isinstance(n, int) for n in row_tokens(batch))


def test_row_tokens_with_bool_masks() -> None:
    batch = Batch(
        tensors={
            "prompt_mask": torch.tensor([[False, True], [True, True]]),
            "response_mask": torch.tensor([[True, False, False], [True, True, False]]),
        }
    )
    assert row_tokens(batch) == [2, 4]


def test_a_rows_pictures_count_their_patches_the_vision_tower_runs_over() -> None:
    from roll.data.images import IMAGES, VisionInputs

    batch = make_batch([[0, 1, 1, 1], [1, 1, 1, 1]], [[1, 1, 0], [1, 0, 0]])
    one_picture = VisionInputs(torch.zeros(16, 8), torch.tensor([[1, 4, 4]]))
    batch[IMAGES] = [None, one_picture]
    assert row_tokens(batch) == [5, 5 + 16]


# --------------------------------------------------------------------------- trim_prompt_padding


def test_trim_drops_only_all_padding_left_columns() -> None:
    batch = make_batch(
        [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]],
        [[1, 1], [1, 0], [1, 1]],
    )
    trimmed = trim_prompt_padding(batch)
    assert torch.equal(trimmed["prompt_mask"], batch["prompt_mask"][:, 2:])
    assert torch.equal(trimmed["prompt_ids"], batch["prompt_ids"][:, 2:])
    assert trimmed["prompt_mask"].shape == (3, 3)
    # No real token was dropped.
    assert row_tokens(trimmed) == row_tokens(batch)


def test_trim_keeps_other_fields_and_leaves_the_input_alone() -> None:
    batch = make_batch([[0, 1, 1], [0, 0, 1]], [[1, 0], [1, 1]])
    before = {key: value.clone() for key, value in batch.tensors.items()}
    trimmed = trim_prompt_padding(batch)
    assert trimmed is not batch
    for key in ("response_ids", "response_mask", "scores"):
        assert torch.equal(trimmed[key], batch[key])
    assert trimmed["prompt_text"] == ["p0", "p1"]
    assert trimmed.meta == {"step": 3}
    assert set(trimmed.keys()) == set(batch.keys())
    assert len(trimmed) == len(batch)
    # The input batch still has its full-width prompt.
    for key, value in before.items():
        assert torch.equal(batch[key], value)
    assert batch["prompt_mask"].shape == (2, 3)


def test_trim_is_a_no_op_without_left_padding_to_drop() -> None:
    batch = make_batch([[1, 1, 1], [0, 1, 1]], [[1], [1]])
    assert trim_prompt_padding(batch) is batch


def test_trim_never_drops_interior_padding() -> None:
    # Only leading columns padded in *every* row go; a padded column after a real one stays.
    batch = make_batch([[0, 1, 0, 1], [0, 0, 1, 1]], [[1], [1]])
    trimmed = trim_prompt_padding(batch)
    assert torch.equal(trimmed["prompt_mask"], torch.tensor([[1, 0, 1], [0, 1, 1]]))


def test_trim_keeps_at_least_one_prompt_column() -> None:
    # The forward pass reads the logit at the last prompt position, so a prompt never becomes empty.
    batch = make_batch([[0, 0, 0], [0, 0, 0]], [[1], [1]])
    trimmed = trim_prompt_padding(batch)
    assert trimmed["prompt_mask"].shape[1] >= 1
    assert trimmed["prompt_ids"].shape[1] == trimmed["prompt_mask"].shape[1]


def test_trim_works_on_selected_rows() -> None:
    # The trainer trims each micro-batch after selecting its rows: short prompts cost only their length.
    batch = make_batch(
        [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]],
        [[1], [1], [1]],
    )
    micro = trim_prompt_padding(batch.select([1, 2]))
    assert micro["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert micro["prompt_ids"].tolist() == batch["prompt_ids"][1:, 2:].tolist()
    assert micro["prompt_text"] == ["p1", "p2"]


def test_trim_of_an_empty_batch_is_a_no_op() -> None:
    batch = Batch(
        tensors={
            "prompt_ids": torch.zeros(0, 3, dtype=torch.long),
            "prompt_mask": torch.zeros(0, 3, dtype=torch.long),
        }
    )
    assert trim_prompt_padding(batch) is batch
