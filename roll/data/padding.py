"""Pad ragged token-id sequences into rectangular tensors.

Prompts are left-padded so that every prompt ends at the same column and generation appends on the
right; responses are right-padded so that token t of every response sits in column t.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["left_pad", "right_pad", "position_ids_from_mask"]


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad on the left to a common length (prompts for generation).

    Args:
        sequences: B token-id sequences (lists of ints or 1-D integer tensors).
        pad_id: id written into padding positions.
        length: target length L; defaults to the longest sequence.

    Returns:
        (input_ids [B, L] long, attention_mask [B, L] long with 1 on real tokens).

    Raises:
        ValueError: a sequence is longer than ``length``.
    """
    return _pad(sequences, pad_id, length, left=True)


def right_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad on the right to a common length (responses); same arguments and returns as ``left_pad``."""
    return _pad(sequences, pad_id, length, left=False)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of each row.

    Under left padding ``arange(L)`` would give the first prompt token a position equal to its number
    of pad tokens, so a padded prompt would be encoded differently from the same prompt alone.

    Args:
        attention_mask: [B, L], 1 (or True) on real tokens.

    Returns:
        [B, L] long: ``cumsum(mask) - 1`` clamped at 0 (pad positions before the first token get 0).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [torch.as_tensor(seq, dtype=torch.long).flatten() for seq in sequences]
    longest = max((row.numel() for row in rows), default=0)
    if length is None:
        length = longest
    elif length < 0:
        raise ValueError(f"pad length must be >= 0, got {length}")
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = row.numel()
        if n > length:
            raise ValueError(f"sequence {i} has {n} tokens, longer than the pad length {length}")
        if n == 0:
            continue
        columns = slice(length - n, length) if left else slice(0, n)
        ids[i, columns] = row
        mask[i, columns] = 1
    return ids, mask
