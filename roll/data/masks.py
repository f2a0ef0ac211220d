"""The two masks of a response, and positions found in them.

A batch's ``response_mask`` [B, R] marks the response tokens the model *sees* (its part of the attention
mask; right-padded). ``loss_mask`` [B, R] marks the tokens *trained on*: a subset of the attended ones.
They differ when a response holds tokens the policy did not sample (an environment's observation between
two turns, a tool's output): those are attended, so later tokens are conditioned on them, but never
trained on and never credited. A batch without ``loss_mask`` trains on every attended token.

Losses, their denominators, advantages, the KL and the training metrics use ``loss_mask``; the forward
pass, response lengths and the reward (which reads the whole attended response) use ``response_mask``.
"""

from __future__ import annotations

import torch

from roll.data.batch import Batch

__all__ = ["last_index", "loss_mask"]


def loss_mask(batch: Batch) -> torch.Tensor:
    """[B, R] the response tokens trained on: the batch's ``loss_mask``, else its ``response_mask``."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] long: the column of each row's last nonzero entry of ``mask`` [B, T], -1 for an all-zero row.

    Found by index, not by ``mask.sum() - 1``: a mask with a hole (``[1, 1, 0, 0, 1, 0]``) ends at
    column 4, not 2."""
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:-1], -1, dtype=torch.long, device=mask.device)
    columns = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), columns, torch.full_like(columns, -1)).amax(dim=-1)
