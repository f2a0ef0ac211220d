"""Micro-batch partitioning: fixed row counts, or dynamic by a token budget.

Pure functions over per-row token counts; the trainer turns the index lists into micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from roll.data.batch import Batch
from roll.data.images import IMAGES


def row_tokens(batch: Batch) -> list[int]:
    """Real (unpadded) prompt + response tokens of each row, and the patches its pictures have: a
    vision-language model's tower runs a transformer over every patch (Qwen2-VL: four per image token)
    before the text model sees one image token, so a row of pictures costs more than its ids say."""
    tokens = (batch["prompt_mask"].sum(dim=1) + batch["response_mask"].sum(dim=1)).tolist()
    pictures = batch.non_tensors.get(IMAGES)
    if pictures is None:
        return tokens
    patches = [0 if seen is None else seen.pixel_values.shape[0] for seen in pictures]
    return [count + extra for count, extra in zip(tokens, patches)]


def count_for_budget(token_counts: Sequence[int], max_tokens: int) -> int:
    """How many contiguous micro-batches of at most ``max_tokens`` tokens the rows need, packed greedily
    in order (a row longer than the budget gets a micro-batch of its own)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive (got {max_tokens})")
    count, used = 0, 0
    for tokens in token_counts:
        if count == 0 or used + tokens > max_tokens:
            count, used = count + 1, 0
        used += tokens
    return count


def balanced_split(token_counts: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices cut into exactly ``parts`` contiguous, non-empty groups of about equal token sums
    (fewer groups when there are fewer rows)."""
    rows = len(token_counts)
    parts = max(1, min(parts, rows))
    total = sum(token_counts)
    groups: list[list[int]] = []
    start, seen = 0, 0
    for part in range(1, parts):
        target = total * part / parts
        end = start + 1  # every group gets at least one row
        seen += token_counts[start]
        # Leave at least one row for each remaining group.
        while end < rows - (parts - part) and seen + token_counts[end] / 2 <= target:
            seen += token_counts[end]
            end += 1
        groups.append(list(range(start, end)))
        start = end
    groups.append(list(range(start, rows)))
    return groups


def fixed_split(rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last one may be shorter)."""
    return [list(range(s, min(s + micro_batch_size, rows))) for s in range(0, rows, micro_batch_size)]


def trim_prompt_padding(batch: Batch) -> Batch:
    """Drop the left prompt columns that are padding in every row: a micro-batch of short prompts then
    costs only its own length. (Trailing response padding is dropped by the forward pass itself.)"""
    mask = batch["prompt_mask"]
    if mask.numel() == 0:
        return batch
    used = mask.any(dim=0).nonzero()
    first = int(used[0]) if len(used) else mask.shape[1] - 1
    if first == 0:
        return batch
    trimmed = Batch(tensors=dict(batch.tensors), non_tensors=dict(batch.non_tensors), meta=dict(batch.meta))
    for key in ("prompt_ids", "prompt_mask"):
        trimmed[key] = batch[key][:, first:]
    return trimmed
