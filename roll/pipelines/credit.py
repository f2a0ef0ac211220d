"""Credit assignment for one rollout batch, as the config asks: response scores -> shaped scores ->
per-token rewards (outcome or process rewards, with the KL penalty when it lives in the reward) ->
advantages and returns.

Glue between ``AlgorithmConfig`` and the pure functions of ``roll.algorithms``; no Ray, no workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from roll.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from roll.algorithms.advantages import clip_advantages, whiten_advantages
from roll.algorithms.functional import masked_mean
from roll.algorithms.reward_shaping import clip_rewards, length_penalty, normalize_rewards, overlong_penalty
from roll.config.rlvr import AlgorithmConfig, RewardShapingConfig
from roll.data.batch import Batch
from roll.data.masks import last_index
from roll.utils.registry import accepted_kwargs

# What a step-wise batch (one row per turn) carries for the per-turn estimators.
PER_TURN_FIELDS = ("episode_index", "turn_index", "turn_rewards", "anchor_index")


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


def outcome_token_rewards(scores: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] rewards: each response's score on its last trained token (found by index, so a loss mask
    with holes still ends where its last 1 is), 0 elsewhere and on rows with no trained token."""
    last = last_index(loss_mask)
    rewards = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    rows = (last >= 0).nonzero().squeeze(-1)
    rewards[rows, last[rows]] = scores.to(torch.float32)[rows]
    return rewards


def token_level_rewards(
    scores: torch.Tensor,
    shaped: torch.Tensor,
    loss_mask: torch.Tensor,
    process_rewards: Sequence[Sequence[float] | None] | None = None,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] rewards from sequence scores and, where a reward gave them, per-token process rewards.

    A row without process rewards gets its shaped score on its last trained token (as
    ``outcome_token_rewards``). A row with process rewards gets them on its response tokens, in order,
    plus the shaping delta ``shaped - score`` on its last trained token: shaping (penalties,
    normalisation, clipping) still applies, and process rewards that sum to the score give the same
    sequence return as the outcome reward would. Estimators that compare sequences (GRPO, RLOO, ...) sum
    token rewards, so for them a row's score is the sum of its process rewards plus the shaping delta.

    A reward sees the whole attended response, so process rewards come one per attended token. One that
    falls on a token outside the loss mask (an environment's observation) is credited to the last trained
    token before it, the action it followed (to the first trained token when none is before it): the
    estimators skip untrained positions, so it would otherwise be lost.

    Args:
        scores: ``[B]`` the rewards' sequence scores, before shaping.
        shaped: ``[B]`` the scores after ``shape_scores``.
        loss_mask: ``[B, T]`` 1 on the response tokens trained on (bool or float).
        process_rewards: per row, one reward per attended response token, or None; None for the whole
            batch means outcome rewards only.
        response_mask: ``[B, T]`` the attended response tokens, right-padded; default ``loss_mask``.

    Returns:
        ``[B, T]`` float32, zero outside ``loss_mask``.

    Raises:
        ValueError: a row's process rewards have not one entry per attended response token of that row.
    """
    rewards = outcome_token_rewards(shaped, loss_mask)
    if process_rewards is None:
        return rewards
    if len(process_rewards) != len(scores):
        raise ValueError(f"process_rewards has {len(process_rewards)} rows for a batch of {len(scores)}")
    attended = (loss_mask if response_mask is None else response_mask).bool()
    trained = loss_mask.bool()
    lasts = last_index(trained).tolist()
    delta = shaped.to(torch.float32) - scores.to(torch.float32)
    for row, per_token in enumerate(process_rewards):
        if per_token is None:
            continue
        positions = attended[row].nonzero().squeeze(-1)
        if len(per_token) != len(positions):
            raise ValueError(
                f"row {row}: {len(per_token)} process rewards for {len(positions)} response tokens; "
                "a process reward needs one entry per response token"
            )
        rewards[row] = 0.0
        targets = _credited_positions(trained[row])[positions]
        kept = targets >= 0  # a row with no trained token has nothing to credit
        rewards[row].index_add_(0, targets[kept], torch.as_tensor(per_token, dtype=torch.float32)[kept])
        if lasts[row] >= 0:
            rewards[row, lasts[row]] += delta[row]
    return rewards


def _credited_positions(trained: torch.Tensor) -> torch.Tensor:
    """[T] long: for each position of one row, the trained position a reward there is credited to: itself
    when trained, else the last trained one before it, else the first trained one (-1: none at all)."""
    columns = torch.arange(len(trained), device=trained.device)
    before = torch.where(trained, columns, torch.full_like(columns, -1)).cummax(dim=0).values
    first = int(trained.nonzero()[0]) if trained.any() else -1
    return torch.where(before >= 0, before, torch.full_like(before, first))


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """[B, T] estimate of KL(policy || reference) on each trained token, 0 elsewhere."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs) * loss_mask.to(torch.float32)


def compute_advantages(
    algo: AlgorithmConfig,
    token_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    per_turn: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The configured estimator, then optional whitening and clipping. Returns ``(advantages, returns)``.

    ``per_turn``: a step-wise batch's ``PER_TURN_FIELDS``, read by the per-turn estimators (GiGPO)."""
    estimator = ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator)
    offered = {
        "values": values,
        "gamma": algo.gamma,
        "lam": algo.lam,
        "norm_adv_by_std": algo.norm_adv_by_std,
        "step_advantage_weight": algo.step_advantage_weight,
        "step_norm": algo.step_norm,
        **(per_turn or {}),
    }
    advantages, returns = estimator(
        token_rewards, loss_mask, group_index, **accepted_kwargs(estimator, offered)
    )
    if algo.whiten_advantages:
        advantages = whiten_advantages(advantages, loss_mask)
    if algo.advantage_clip is not None:
        advantages = clip_advantages(advantages, algo.advantage_clip)
    return advantages, returns


def advantage_metrics(advantages: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    mask = loss_mask.to(torch.float32)
    return {
        "advantages/mean": masked_mean(advantages, mask).item(),
        "advantages/abs_mean": masked_mean(advantages.abs(), mask).item(),
        "returns/mean": masked_mean(returns, mask).item(),
    }


def reward_metrics(
    batch: Batch, shaped: torch.Tensor | None, real: torch.Tensor, grouped: bool
) -> dict[str, float]:
    """Rewards and lengths of a training batch's ``real`` rows (not those that only pad it to a divisor):
    mean and spread, the share of groups that carry no GRPO signal (all one reward; only when ``grouped``:
    with one sample per prompt every group trivially agrees), and the shaped reward's mean."""
    scores, lengths = batch["scores"][real].float(), batch["response_mask"][real].sum(dim=1).float()
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
        "response/length_mean": lengths.mean().item(),
        "rollout/samples": int(real.sum()),  # trained rows: `roll plot --x samples` sums them
    }
    if grouped:
        _, group = torch.unique(batch["group_index"][real], return_inverse=True)
        count = int(group.max()) + 1
        high = torch.full((count,), -torch.inf).scatter_reduce(0, group, scores, "amax")
        low = torch.full((count,), torch.inf).scatter_reduce(0, group, scores, "amin")
        metrics["reward/all_same_group_frac"] = (high == low).float().mean().item()
    if shaped is not None:
        metrics["reward/shaped_mean"] = shaped[real].mean().item()
    return metrics
