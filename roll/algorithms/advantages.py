"""Advantage estimators: turn per-token rewards into per-token advantages (and returns).

Every estimator has the same signature, so the pipeline can pick one by name from the config::

    fn(token_level_rewards, loss_mask, group_index, **params) -> (advantages, returns)

Args shared by all estimators:
    token_level_rewards: ``[B, T]`` reward per response token; for outcome rewards the score sits on
        the last trained token and the rest is zero (per-token KL penalties may be added on top).
    loss_mask: ``[B, T]`` 1 for the response tokens trained on; 0 for padding and for tokens the policy
        did not sample (an environment's observation inside a multi-turn response, see
        ``roll.data.masks``). Bool or float.
    group_index: ``[B]`` long; samples generated from the same prompt share a value. Values are
        arbitrary ids: groups need not be contiguous in the batch nor numbered from 0.

Optional params, passed by the caller only when the estimator declares them (see
``roll.utils.registry.accepted_kwargs``): ``values`` (``[B, T]`` critic values, or None), ``gamma``
(discount), ``lam`` (GAE lambda), ``norm_adv_by_std`` (GRPO's std division), ``episode_index`` (``[B]``:
the sequence-level estimators count the rows of one episode, an agent run's branches, once).

Returns ``(advantages, returns)``, both ``[B, T]`` float32 and zero outside ``loss_mask``.
Estimators compute no gradient.

Every estimator is registered with two traits the config validator reads:
``needs_groups`` (it compares the samples of one prompt, so it needs at least 2 per prompt) and
``needs_values`` (it needs a critic). Add one with::

    @ADVANTAGE_ESTIMATORS.register("name", needs_groups=False, needs_values=False)

``whiten_advantages`` and ``clip_advantages`` are optional post-processing steps, not estimators.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.algorithms.functional import masked_whiten
from roll.utils.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def _sequence_scores(token_level_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token rewards -> ``[B]`` float32 scores, ignoring rewards on padding."""
    mask = loss_mask.to(torch.float32)
    return (token_level_rewards.to(torch.float32) * mask).sum(dim=-1)


def _per_token(per_sequence: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-sequence value -> ``[B, T]``, the value on every response token and 0 on padding."""
    return per_sequence.unsqueeze(-1) * loss_mask.to(torch.float32)


def _group_stats(
    scores: torch.Tensor, group_index: torch.Tensor, episode_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(mean, unbiased std, size)`` of the sample's own group, each ``[B]``.

    Vectorised with ``index_add_`` over dense group ids, so the cost is independent of how many
    groups there are. A group of one sample has mean equal to its score and std 0.

    ``episode_index``: the rows of one episode (an agent run's branches) count once between them, and
    ``size`` counts episodes; rows with -1 (padding) count for nothing.
    """
    weights = torch.ones_like(scores)
    if episode_index is not None:
        _, episode, rows = torch.unique(episode_index, return_inverse=True, return_counts=True)
        weights = torch.where(episode_index >= 0, 1.0 / rows[episode].to(scores.dtype), 0.0)
    _, dense = torch.unique(group_index, return_inverse=True)
    num_groups = int(dense.max().item()) + 1 if dense.numel() else 0
    counts = scores.new_zeros(num_groups).index_add_(0, dense, weights)
    sums = scores.new_zeros(num_groups).index_add_(0, dense, scores * weights)
    mean = (sums / counts.clamp(min=1e-12))[dense]
    squares = scores.new_zeros(num_groups).index_add_(0, dense, weights * (scores - mean) ** 2)
    # Bessel's correction; clamping n - 1 at 1 makes a singleton's std 0 instead of 0/0.
    std = (squares / (counts - 1).clamp(min=1)).sqrt()[dense]
    return mean, std, counts[dense]


def group_mean_std(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased std of ``scores`` within each sample's group.

    Args:
        scores: ``[B]`` float.
        group_index: ``[B]`` long group ids (arbitrary values, any order).

    Returns:
        ``(mean, std)``, each ``[B]``: the statistics of the sample's own group. The std is the
        unbiased one (divides by ``n - 1``, ``torch.std``'s default); a group of one sample has
        mean equal to its score and std 0.
    """
    mean, std, _ = _group_stats(scores, group_index)
    return mean, std


def _reverse_discounted_sum(values: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """``out_t = values_t + discount * out_{t'}`` where ``t'`` is the next masked position after ``t``.

    Positions outside ``mask`` are skipped: they add nothing and cost no discount step, so an
    environment segment inside a multi-turn response is transparent, and the sum after the last masked
    token is 0 (terminal). Python loop over ``T``, vectorised over the batch.

    Args:
        values: ``[B, T]`` float32.
        mask: ``[B, T]`` bool.
        discount: factor per masked step.

    Returns:
        ``[B, T]`` float32, zero outside ``mask``.
    """
    out = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[-1])):
        running = torch.where(mask[:, t], values[:, t] + discount * running, running)
        out[:, t] = running
    return out * mask


def _next_masked_value(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` value at the next masked position after each position; 0 after the last one."""
    out = torch.zeros_like(values)
    upcoming = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[-1])):
        out[:, t] = upcoming
        upcoming = torch.where(mask[:, t], values[:, t], upcoming)
    return out


@ADVANTAGE_ESTIMATORS.register("grpo", needs_groups=True, needs_values=False)
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    episode_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each response's score relative to the other responses to the same prompt.

    ``score = sum_t token_level_rewards * loss_mask``, then per group::

        advantage = (score - mean_group) / (std_group + eps)   if norm_adv_by_std
        advantage =  score - mean_group                        otherwise

    ``std_group`` is the unbiased standard deviation (``torch.std`` default, divides by ``n - 1``).
    The scalar advantage is broadcast to every response token and zeroed on padding.

    Edge cases: a group of size 1 gets advantage 0 (its mean is its own score: there is nothing to
    compare against); a group whose scores are all equal also gets 0 (the numerator is 0), so it
    contributes no gradient.

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` long.
        norm_adv_by_std: divide by the group std (GRPO); ``False`` gives the Dr. GRPO variant, which
            avoids up-weighting groups whose rewards barely differ.
        eps: keeps the division finite for groups with (near) zero std.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns equal advantages.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, loss_mask)
        mean, std, _ = _group_stats(scores, group_index, episode_index)
        centred = scores - mean
        advantage = centred / (std + eps) if norm_adv_by_std else centred
        advantages = _per_token(advantage, loss_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("dr_grpo", needs_groups=True, needs_values=False)
def dr_grpo_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    episode_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``score - mean_group``.

    GRPO without the division by the group std, which up-weights prompts whose responses score
    almost alike. The paper's other change, not normalising by each response's length, is the
    ``seq-mean-token-sum-norm`` loss aggregation. Same as ``grpo`` with ``norm_adv_by_std=False``;
    this entry exists so the choice cannot be overridden by the ``norm_adv_by_std`` config knob.

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` long.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns equal advantages.
    """
    return grpo_advantages(
        token_level_rewards, loss_mask, group_index, norm_adv_by_std=False, episode_index=episode_index
    )


@ADVANTAGE_ESTIMATORS.register("rloo", needs_groups=True, needs_values=False)
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    episode_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline within each group.

    Each response is compared with the mean score of the *other* responses to its prompt::

        advantage_i = score_i - mean_{j != i} score_j = n / (n - 1) * (score_i - mean_group)

    for a group of ``n`` responses. The baseline does not depend on ``score_i``, so the estimate stays
    unbiased. A group of one sample gets 0 (no other response to compare with).

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` long.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns equal advantages.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, loss_mask)
        mean, _, size = _group_stats(scores, group_index, episode_index)
        # Singleton: the centred score is 0 already; the clamp only avoids 1 / 0.
        advantage = (scores - mean) * size / (size - 1).clamp(min=1)
        advantages = _per_token(advantage, loss_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline", needs_groups=False, needs_values=False)
def reinforce_baseline_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    episode_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with the batch-mean score as baseline: ``advantage = score - mean_batch(score)``.

    ``group_index`` is accepted for the uniform signature and ignored: the baseline is shared by the
    whole batch. No std normalisation.

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` (unused).

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns equal advantages.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, loss_mask)
        mean, _, _ = _group_stats(scores, torch.zeros_like(group_index), episode_index)
        advantages = _per_token(scores - mean, loss_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", needs_groups=False, needs_values=False)
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the batch.

    ::

        G_t = sum_{k >= t} gamma^(k - t) * r_k        (over response tokens only)
        advantage = (G - mean(G)) / std(G)            (mean, unbiased std over all masked tokens)

    Per-token rewards (e.g. a KL penalty on every token plus the score on the last) are credited to
    the tokens before them. Masked-out positions inside a response (environment tokens) neither add
    reward nor count as a discount step. The whitening replaces a critic or group baseline.

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` (unused).
        gamma: discount per response token.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns are ``G`` before whitening.
    """
    with torch.no_grad():
        mask = loss_mask.to(torch.bool)
        returns = _reverse_discounted_sum(token_level_rewards.to(torch.float32), mask, gamma)
        advantages = whiten_advantages(returns, loss_mask)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", needs_groups=True, needs_values=False)
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: ``score - mean_group``, then whitened over the batch.

    The group-centred score is broadcast to the response's tokens and whitened (zero mean, unit
    unbiased std) over all masked tokens of the batch, so the scale is set by the whole batch rather
    than by each group's own std as in GRPO.

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` long.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; returns are the group-centred scores per
        token, before whitening.
    """
    centred, _ = dr_grpo_advantages(token_level_rewards, loss_mask, group_index)
    with torch.no_grad():
        advantages = whiten_advantages(centred, loss_mask)
    return advantages, centred


@ADVANTAGE_ESTIMATORS.register("gae", needs_groups=False, needs_values=True)
def gae_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) with a critic.

    With ``V_t`` the value of the state before response token ``t``::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V

    The state after the last response token is terminal (``V = 0``, ``A = 0``), so right padding
    never leaks in. Masked-out positions inside a response (environment tokens) are skipped: the
    "next" token of a response token is the next masked one. ``lam = 1`` gives the Monte-Carlo
    return minus ``V``; ``lam = 0`` gives the one-step TD error. No whitening here: the caller may
    apply ``whiten_advantages``.

    Args:
        token_level_rewards: ``[B, T]``.
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` (unused).
        values: ``[B, T]`` critic values (required).
        gamma: discount per response token.
        lam: GAE bias/variance trade-off in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; ``returns`` are the critic's targets.

    Raises:
        ValueError: when ``values`` is missing or its shape differs from the rewards'.
    """
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values (values=None was given)")
    if values.shape != token_level_rewards.shape:
        shapes = f"{tuple(values.shape)} vs {tuple(token_level_rewards.shape)}"
        raise ValueError(f"'gae' needs values shaped like the rewards, got {shapes}")
    with torch.no_grad():
        mask = loss_mask.to(torch.bool)
        weight = loss_mask.to(torch.float32)
        current = values.to(torch.float32) * weight
        deltas = token_level_rewards.to(torch.float32) + gamma * _next_masked_value(current, mask) - current
        advantages = _reverse_discounted_sum(deltas, mask, gamma * lam)
        returns = (advantages + current) * weight
    return advantages, returns


def whiten_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Shift and scale advantages to zero mean and unit (unbiased) std over all masked tokens.

    Args:
        advantages: ``[B, T]``.
        loss_mask: ``[B, T]`` bool or float.

    Returns:
        ``[B, T]`` float32, zero outside the mask. A batch whose masked advantages are all equal
        becomes all zeros.
    """
    with torch.no_grad():
        whitened = masked_whiten(advantages.to(torch.float32), loss_mask)
        return whitened * loss_mask.to(torch.float32)


def clip_advantages(advantages: torch.Tensor, max_abs: float) -> torch.Tensor:
    """Clamp advantages to ``[-max_abs, max_abs]`` (after whitening, this bounds outliers).

    Args:
        advantages: ``[B, T]``.
        max_abs: positive bound.

    Returns:
        ``[B, T]``, same dtype; zeros stay zero, so padding is unaffected.

    Raises:
        ValueError: when ``max_abs <= 0``.
    """
    if not max_abs > 0:
        raise ValueError(f"advantage clip bound must be > 0, got {max_abs}")
    return advantages.clamp(min=-max_abs, max=max_abs)
