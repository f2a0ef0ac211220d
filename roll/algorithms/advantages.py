"""Advantage estimators: turn per-token rewards into per-token advantages (and returns).

Every estimator has the same signature, so the pipeline can pick one by name from the config::

    fn(token_level_rewards, response_mask, group_index, **params) -> (advantages, returns)

Args shared by all estimators:
    token_level_rewards: ``[B, T]`` reward per response token; for outcome rewards the score sits on
        the last response token and the rest is zero.
    response_mask: ``[B, T]`` 1 for response tokens that are trained on, 0 for padding (bool or float).
    group_index: ``[B]`` long; samples generated from the same prompt share a value. Values are
        arbitrary ids: groups need not be contiguous in the batch nor numbered from 0.

Returns ``(advantages, returns)``, both ``[B, T]`` float32 and zero outside ``response_mask``.
Estimators compute no gradient.

Add an estimator by writing one function with this signature and decorating it with
``@ADVANTAGE_ESTIMATORS.register("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.utils.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token rewards -> ``[B]`` float32 scores, ignoring rewards on padding."""
    mask = response_mask.to(torch.float32)
    return (token_level_rewards.to(torch.float32) * mask).sum(dim=-1)


def group_mean_std(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased std of ``scores`` within each sample's group.

    Vectorised with ``index_add_`` over dense group ids, so the cost is independent of how many
    groups there are.

    Args:
        scores: ``[B]`` float.
        group_index: ``[B]`` long group ids (arbitrary values, any order).

    Returns:
        ``(mean, std)``, each ``[B]``: the statistics of the sample's own group. The std is the
        unbiased one (divides by ``n - 1``, ``torch.std``'s default); a group of one sample has
        mean equal to its score and std 0.
    """
    _, dense = torch.unique(group_index, return_inverse=True)
    num_groups = int(dense.max().item()) + 1 if dense.numel() else 0
    counts = scores.new_zeros(num_groups).index_add_(0, dense, torch.ones_like(scores))
    sums = scores.new_zeros(num_groups).index_add_(0, dense, scores)
    mean = (sums / counts)[dense]
    squares = scores.new_zeros(num_groups).index_add_(0, dense, (scores - mean) ** 2)
    # Bessel's correction; clamping n - 1 at 1 makes a singleton's std 0 instead of 0/0.
    std = (squares / (counts - 1).clamp(min=1)).sqrt()[dense]
    return mean, std


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each response's score relative to the other responses to the same prompt.

    ``score = sum_t token_level_rewards * response_mask``, then per group::

        advantage = (score - mean_group) / (std_group + eps)   if norm_adv_by_std
        advantage =  score - mean_group                        otherwise

    ``std_group`` is the unbiased standard deviation (``torch.std`` default, divides by ``n - 1``).
    The scalar advantage is broadcast to every response token and zeroed on padding.

    Edge cases: a group of size 1 gets advantage 0 (its mean is its own score: there is nothing to
    compare against); a group whose scores are all equal also gets 0 (the numerator is 0), so it
    contributes no gradient.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        group_index: ``[B]`` long.
        norm_adv_by_std: divide by the group std (GRPO); ``False`` gives the Dr. GRPO variant, which
            avoids up-weighting groups whose rewards barely differ.
        eps: keeps the division finite for groups with (near) zero std.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns equal advantages.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        mean, std = group_mean_std(scores, group_index)
        centred = scores - mean
        advantage = centred / (std + eps) if norm_adv_by_std else centred
        advantages = advantage.unsqueeze(-1) * response_mask.to(torch.float32)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline")
def reinforce_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with the batch-mean score as baseline: ``advantage = score - mean_batch(score)``.

    ``group_index`` is accepted for the uniform signature and ignored: the baseline is shared by the
    whole batch. No std normalisation.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        group_index: ``[B]`` (unused).

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns equal advantages.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        advantage = scores - scores.mean()
        advantages = advantage.unsqueeze(-1) * response_mask.to(torch.float32)
    return advantages, advantages
