"""Credit assignment for one rollout batch, as the config asks: response scores -> shaped scores ->
per-token rewards (outcome or process rewards, with the KL penalty when it lives in the reward) ->
advantages and returns.

Glue between ``AlgorithmConfig`` and the pure functions of ``roll.algorithms``; no Ray, no workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roll.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from roll.algorithms.advantages import clip_advantages, whiten_advantages
from roll.algorithms.functional import masked_mean
from roll.algorithms.reward_shaping import clip_rewards, length_penalty, normalize_rewards, overlong_penalty
from roll.config.rlvr import AlgorithmConfig, RewardShapingConfig
from roll.utils.registry import accepted_kwargs


def shaping_enabled(shaping: RewardShapingConfig) -> bool:
    """Whether any shaping option is set (then ``reward/shaped_mean`` is logged every step)."""
    penalties = bool(shaping.overlong_buffer or shaping.length_penalty_coef)
    return penalties or shaping.normalize or shaping.clip is not None


def shape_scores(
    scores: torch.Tensor, lengths: torch.Tensor, shaping: RewardShapingConfig, max_new_tokens: int
) -> torch.Tensor:
    """``scores`` [B] with the configured penalties added, then normalised, then clipped."""
    shaped = scores.to(torch.float32)
    if shaping.overlong_buffer:
        shaped = shaped + overlong_penalty(
            lengths, max_new_tokens, shaping.overlong_buffer, shaping.overlong_penalty_factor
        )
    if shaping.length_penalty_coef:
        shaped = shaped + length_penalty(lengths, max_new_tokens, shaping.length_penalty_coef)
    if shaping.normalize:
        shaped = normalize_rewards(shaped)
    if shaping.clip is not None:
        shaped = clip_rewards(shaped, shaping.clip)
    return shaped


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] rewards: each response's score on its last response token, 0 elsewhere."""
    mask = response_mask.to(torch.float32)
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), last] = scores.to(torch.float32)
    return rewards * mask


def token_level_rewards(
    scores: torch.Tensor,
    shaped: torch.Tensor,
    response_mask: torch.Tensor,
    process_rewards: Sequence[Sequence[float] | None] | None = None,
) -> torch.Tensor:
    """[B, T] rewards from sequence scores and, where a reward gave them, per-token process rewards.

    A row without process rewards gets its shaped score on its last response token (as
    ``outcome_token_rewards``). A row with process rewards gets them on its response tokens, in order,
    plus the shaping delta ``shaped - score`` on its last response token: shaping (penalties,
    normalisation, clipping) still applies, and process rewards that sum to the score give the same
    sequence return as the outcome reward would. Estimators that compare sequences (GRPO, RLOO, ...) sum
    token rewards, so for them a row's score is the sum of its process rewards plus the shaping delta.

    Args:
        scores: ``[B]`` the rewards' sequence scores, before shaping.
        shaped: ``[B]`` the scores after ``shape_scores``.
        response_mask: ``[B, T]`` 1 on response tokens (bool or float), right-padded.
        process_rewards: per row, one reward per response token, or None; None for the whole batch
            means outcome rewards only.

    Returns:
        ``[B, T]`` float32, zero outside ``response_mask``.

    Raises:
        ValueError: a row's process rewards have not one entry per response token of that row.
    """
    rewards = outcome_token_rewards(shaped, response_mask)
    if process_rewards is None:
        return rewards
    if len(process_rewards) != len(scores):
        raise ValueError(f"process_rewards has {len(process_rewards)} rows for a batch of {len(scores)}")
    mask = response_mask.bool()
    delta = shaped.to(torch.float32) - scores.to(torch.float32)
    for row, per_token in enumerate(process_rewards):
        if per_token is None:
            continue
        positions = mask[row].nonzero().squeeze(-1)
        if len(per_token) != len(positions):
            raise ValueError(
                f"row {row}: {len(per_token)} process rewards for {len(positions)} response tokens; "
                "a process reward needs one entry per response token"
            )
        rewards[row] = 0.0
        rewards[row, positions] = torch.as_tensor(per_token, dtype=torch.float32)
        if len(positions):
            rewards[row, positions[-1]] += delta[row]
    return rewards


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """[B, T] estimate of KL(policy || reference) on each response token, 0 on padding."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs) * response_mask.to(torch.float32)


def compute_advantages(
    algo: AlgorithmConfig,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The configured estimator, then optional whitening and clipping. Returns ``(advantages, returns)``."""
    estimator = ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator)
    offered = {
        "values": values,
        "gamma": algo.gamma,
        "lam": algo.lam,
        "norm_adv_by_std": algo.norm_adv_by_std,
    }
    advantages, returns = estimator(
        token_rewards, response_mask, group_index, **accepted_kwargs(estimator, offered)
    )
    if algo.whiten_advantages:
        advantages = whiten_advantages(advantages, response_mask)
    if algo.advantage_clip is not None:
        advantages = clip_advantages(advantages, algo.advantage_clip)
    return advantages, returns


def advantage_metrics(advantages: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> dict:
    mask = response_mask.to(torch.float32)
    return {
        "advantages/mean": masked_mean(advantages, mask).item(),
        "advantages/abs_mean": masked_mean(advantages.abs(), mask).item(),
        "returns/mean": masked_mean(returns, mask).item(),
    }
