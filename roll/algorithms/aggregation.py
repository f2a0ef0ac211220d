"""Loss aggregation: how a ``[B, T]`` matrix of per-token losses becomes one scalar.

Every mode has the signature ``fn(loss_mat [B, T], mask [B, T], denominator=None) -> scalar`` and is
selected by name (``algorithm.loss_agg_mode`` in the config). Each mode divides a sum by a count:

- ``token-mean``: ``sum of token losses / number of trained tokens``. Every trained token weighs the
  same, whatever the length of its sequence.
- ``seq-mean-token-mean``: ``sum over sequences of the mean token loss / number of sequences``. Every
  sequence weighs the same; long sequences' tokens weigh less.
- ``seq-mean-token-sum``: ``sum of token losses / number of sequences``. Every sequence contributes
  its summed token loss, so long sequences contribute more (no length normalisation).
- ``seq-mean-token-sum-norm``: ``sum of token losses / (number of sequences * T)``, with ``T`` the
  padded response width (``loss_mat.shape[-1]``, fixed at ``rollout.max_new_tokens``). Dr. GRPO's
  choice: divide by a constant generation budget instead of each response's own length, so neither
  short nor long responses are favoured per token.

Why ``denominator``: an optimizer step usually covers a mini-batch split into micro-batches whose
gradients are accumulated. If each micro-batch divided by its *own* count, micro-batches with few
tokens (or sequences) would be over-weighted and the result would depend on how the mini-batch was
split. Passing the whole mini-batch's count as ``denominator`` makes the sum of the micro-batch losses
equal the loss of one big batch, hence the same gradient::

    count = aggregation_count(mode, full_mask)   # summed over data-parallel ranks, divided by
    sum(fn(loss[rows], mask[rows], count) for rows in split) == fn(loss, full_mask)   # their number

Each mode is registered with the trait ``count``, a function ``mask -> scalar float32 tensor`` giving
that natural denominator (not clamped, so counts from several ranks can be summed); read it with
``aggregation_count``. Without ``denominator``, the local count clamped to at least 1 is used.

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


def _num_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Number of trained tokens in ``mask`` [B, T] (float32 scalar; a float mask's total weight)."""
    return mask.to(torch.float32).sum()


def _num_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of ``mask`` [B, T] with at least one trained token (float32 scalar)."""
    return (mask.to(torch.float32).sum(dim=-1) > 0).sum().to(torch.float32)


def _num_sequences_times_width(mask: torch.Tensor) -> torch.Tensor:
    """Number of non-empty rows times the padded width ``T`` (float32 scalar)."""
    return _num_sequences(mask) * mask.shape[-1]


def aggregation_count(mode: str, mask: torch.Tensor) -> torch.Tensor:
    """The natural denominator of aggregation ``mode`` for ``mask``, as a float32 scalar tensor.

    Compute it on a whole mini-batch and pass it as ``denominator`` to every micro-batch's call so
    the accumulated loss equals the one-batch loss (see the module docstring).

    Args:
        mode: ``LOSS_AGGREGATIONS`` name.
        mask: ``[B, T]`` bool or float.

    Returns:
        Scalar tensor, possibly 0 for an all-padding mask (clamp before dividing by it).
    """
    return LOSS_AGGREGATIONS.traits(mode)["count"](mask)


def _divide(total: torch.Tensor, mask: torch.Tensor, denominator, count: Callable) -> torch.Tensor:
    """``total / denominator``, the denominator defaulting to ``count(mask)`` clamped to >= 1."""
    if denominator is None:
        denominator = count(mask).clamp(min=1)
    elif not denominator > 0:
        raise ValueError(f"loss aggregation denominator must be > 0, got {denominator}")
    return total / denominator


@LOSS_AGGREGATIONS.register("token-mean", count=_num_tokens)
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """``sum(loss * mask) / denominator``, the denominator defaulting to the number of masked tokens.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` bool or float.
        denominator: total token count of the whole mini-batch, for gradient accumulation.

    Returns:
        Scalar tensor.
    """
    return _divide(masked_sum(loss_mat, mask), mask, denominator, _num_tokens)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean", count=_num_sequences)
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
    tokens_per_seq = mask.to(loss_mat.dtype).sum(dim=-1).clamp(min=1)
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / tokens_per_seq
    return _divide(seq_losses.sum(), mask, denominator, _num_sequences)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum", count=_num_sequences)
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
    return _divide(masked_sum(loss_mat, mask), mask, denominator, _num_sequences)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm", count=_num_sequences_times_width)
def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
) -> torch.Tensor:
    """Summed token loss divided by ``number of sequences * T`` (Dr. GRPO's constant normaliser).

    ``T = loss_mat.shape[-1]`` is the padded response width; it must be the same for every
    micro-batch (ROLL pads responses to ``rollout.max_new_tokens``) for the split invariance to hold.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` bool or float.
        denominator: replaces ``number of (non-empty) sequences * T``, for gradient accumulation.

    Returns:
        Scalar tensor.
    """
    return _divide(masked_sum(loss_mat, mask), mask, denominator, _num_sequences_times_width)
