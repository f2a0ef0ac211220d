"""Reward shaping: adjustments to the per-response scores ``[B]`` before advantages are computed.

All functions are pure and work on ``[B]`` float tensors (one entry per response). The pipeline
applies them in this order:

1. penalties (``overlong_penalty``, ``length_penalty``) are *added* to the verifier's score;
2. ``normalize_rewards`` standardises the penalised scores over the batch;
3. ``clip_rewards`` bounds the result.

Normalising before clipping makes the clip bound mean "this many standard deviations", whatever
the raw reward scale. Penalties come first so that they are normalised together with the score.
"""

from __future__ import annotations

import torch


def _as_float(lengths: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(lengths).to(torch.float32)


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): a penalty ramping up near the length limit.

    With ``L`` the response length and ``start = max_length - buffer_length``::

        0                                           if L <= start
        (start - L) / buffer_length * penalty_factor   if start < L <= max_length   (0 down to -factor)
        -penalty_factor                             if L > max_length

    Responses truncated at the limit are penalised gradually instead of all-or-nothing, which would
    punish a sound but long derivation as hard as rambling.

    Args:
        lengths: ``[B]`` response lengths in tokens (int or float).
        max_length: the generation limit.
        buffer_length: width of the ramp, in ``(0, max_length]``.
        penalty_factor: the penalty at and beyond ``max_length`` is ``-penalty_factor``.

    Returns:
        ``[B]`` float32 penalties (<= 0), to add to the scores.

    Raises:
        ValueError: when ``buffer_length`` is outside ``(0, max_length]``.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"overlong buffer_length must be in (0, {max_length}], got {buffer_length}")
    lengths = _as_float(lengths)
    start = max_length - buffer_length
    ramp = (start - lengths) / buffer_length * penalty_factor
    penalty = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return torch.where(lengths > max_length, torch.full_like(ramp, -penalty_factor), penalty)


def length_penalty(lengths: torch.Tensor, max_length: int, coef: float) -> torch.Tensor:
    """A penalty proportional to the response length: ``-coef * L / max_length``.

    Args:
        lengths: ``[B]`` response lengths in tokens.
        max_length: length that costs ``coef``; > 0.
        coef: penalty at ``max_length``.

    Returns:
        ``[B]`` float32 penalties, to add to the scores.

    Raises:
        ValueError: when ``max_length <= 0``.
    """
    if not max_length > 0:
        raise ValueError(f"length penalty needs max_length > 0, got {max_length}")
    return -coef * _as_float(lengths) / max_length


def normalize_rewards(scores: torch.Tensor) -> torch.Tensor:
    """Standardise scores over the batch: ``(s - mean) / (std + 1e-6)``, ``std`` unbiased.

    Args:
        scores: ``[B]``.

    Returns:
        ``[B]`` float32; all zeros for a batch of one or a constant batch.
    """
    scores = _as_float(scores)
    if scores.numel() <= 1:
        return torch.zeros_like(scores)
    return (scores - scores.mean()) / (scores.std() + 1e-6)


def clip_rewards(scores: torch.Tensor, bound: float) -> torch.Tensor:
    """Clamp scores to ``[-bound, bound]``.

    Args:
        scores: ``[B]``.
        bound: > 0.

    Returns:
        ``[B]``, same dtype as ``scores``.

    Raises:
        ValueError: when ``bound <= 0``.
    """
    if not bound > 0:
        raise ValueError(f"reward clip bound must be > 0, got {bound}")
    return scores.clamp(min=-bound, max=bound)
