"""Loss aggregation: how a ``[B, T]`` matrix of per-token losses becomes one scalar.

Every mode has the signature ``fn(loss_mat [B, T], mask [B, T], denominator=None) -> scalar`` and is
selected by name (``algorithm.loss_agg_mode`` in the config):

- ``token-mean``: every trained token weighs the same, whatever the length of its sequence.
- ``seq-mean-token-mean``: every sequence weighs the same; long sequences' tokens weigh less.
- ``seq-mean-token-sum``: every sequence weighs the same and contributes its summed token loss, so
  long sequences contribute more (no length normalisation).

Why ``denominator``: an optimizer step usually covers a mini-batch split into micro-batches whose
gradients are accumulated. If each micro-batch divided by its *own* token (or sequence) count, micro
batches with few tokens would be over-weighted and the result would depend on how the mini-batch was
split. Passing the whole mini-batch's count (divided by the number of data-parallel ranks when
gradients are averaged across them) as ``denominator`` makes the sum of the micro-batch losses equal
the loss of one big batch, hence the same gradient. Without it, the local count is used.

Sequences whose mask is all zero (padding rows, e.g. from padding a batch to a divisor) are not
counted as sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.algorithms.functional import masked_sum
from roll.utils.registry import Registry

AggregationFn = Callable[..., torch.Tensor]
LOSS_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation mode")


def _check_denominator(denominator: float | None) -> None:
    if denominator is not None and not denominator > 0:
        raise ValueError(f"loss aggregation denominator must be > 0, got {denominator}")


def _num_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of ``mask`` [B, T] with at least one trained token (at least 1)."""
    return (mask.to(torch.float32).sum(dim=-1) > 0).sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """``sum(loss * mask) / denominator``, the denominator defaulting to the number of masked tokens.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` bool or float.
        denominator: total token count of the whole mini-batch, for gradient accumulation.

    Returns:
        Scalar tensor.
    """
    _check_denominator(denominator)
    if denominator is None:
        denominator = mask.to(loss_mat.dtype).sum().clamp(min=1)
    return masked_sum(loss_mat, mask) / denominator


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
) -> torch.Tensor:
    """Mean over sequences of each sequence's mean token loss.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` bool or float.
        denominator: replaces the number of (non-empty) sequences, for gradient accumulation.

    Returns:
        Scalar tensor.
    """
    _check_denominator(denominator)
    tokens_per_seq = mask.to(loss_mat.dtype).sum(dim=-1).clamp(min=1)
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / tokens_per_seq
    if denominator is None:
        denominator = _num_sequences(mask)
    return seq_losses.sum() / denominator


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
) -> torch.Tensor:
    """Mean over sequences of each sequence's summed token loss.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` bool or float.
        denominator: replaces the number of (non-empty) sequences, for gradient accumulation.

    Returns:
        Scalar tensor.
    """
    _check_denominator(denominator)
    seq_losses = masked_sum(loss_mat, mask, dim=-1)
    if denominator is None:
        denominator = _num_sequences(mask)
    return seq_losses.sum() / denominator
