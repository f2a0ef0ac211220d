"""Policy losses, the value loss, and the KL / entropy regularisers that the actor adds to them.

Every policy loss has the signature::

    fn(logprobs, old_logprobs, advantages, loss_mask, *,
       loss_agg_mode="token-mean", denominator=None, **params) -> (loss, metrics)

Args shared by all policy losses:
    logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the policy being trained
        (carries the gradient).
    old_logprobs: ``[B, T]`` the same under the policy that generated the samples (no gradient).
    advantages: ``[B, T]``.
    loss_mask: ``[B, T]`` bool or float; 0 for padding and environment tokens.
    loss_agg_mode: name in ``LOSS_AGGREGATIONS``; ``denominator`` is passed through to it.

Optional params, passed by the caller only when the loss declares them (see
``roll.utils.registry.accepted_kwargs``): ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``.

Returns a scalar loss tensor to minimise and a dict of python floats for logging (computed without
gradient), always with ``clip_frac``, ``approx_kl``, ``ratio_mean`` and ``ratio_max`` (see
``ppo_clip_loss``). Add a loss with ``@POLICY_LOSSES.register("name")``.

Every built-in policy loss is linear in the advantage with a positive weight per token, so scaling a
token's advantage (e.g. by ``truncated_is_weights``) scales that token's loss and gradient alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.algorithms.aggregation import LOSS_AGGREGATIONS
from roll.algorithms.functional import masked_mean, masked_var
from roll.algorithms.kl import KL_ESTIMATORS
from roll.utils.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

# exp(20) ~ 5e8 is far outside any trust region yet finite in float32 and bf16; without the clamp a
# stale or corrupted logprob gives inf * 0 = NaN in the loss.
_LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs - old_logprobs`` clamped to ``[-20, 20]`` (``[B, T]``, differentiable)."""
    return (logprobs - old_logprobs).clamp(min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic per-token loss and where its clipped branch is the one used (both ``[B, T]``).

    ``loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - low, 1 + high))``.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(min=1.0 - clip_ratio_low, max=1.0 + clip_ratio_high)
    clip_active = clipped > unclipped
    # where() rather than maximum(): on ties maximum() splits the gradient between the two branches,
    # which would halve it at the trust-region boundary.
    return torch.where(clip_active, clipped, unclipped), clip_active


@torch.no_grad()
def _ratio_metrics(
    log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """The metrics every policy loss reports, as python floats over masked tokens.

    Args:
        log_ratio: ``[B, T]`` per-token ``logprobs - old_logprobs``, for ``approx_kl``.
        ratio: ``[B, T]`` the importance ratio the loss uses, for ``ratio_mean`` / ``ratio_max``.
        clipped: ``[B, T]`` bool, tokens counted in ``clip_frac``.
        loss_mask: ``[B, T]``.
    """
    mask = loss_mask.to(torch.bool)
    ratio = ratio.detach().float()
    return {
        "clip_frac": masked_mean(clipped.float(), loss_mask).item(),
        "approx_kl": masked_mean(0.5 * log_ratio.detach().float() ** 2, loss_mask).item(),
        "ratio_mean": masked_mean(ratio, loss_mask).item(),
        "ratio_max": ratio[mask].max().item() if mask.any() else 0.0,
    }


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate objective (negated, to minimise).

    With ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to ``[-20, 20]``)::

        loss_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    i.e. the pessimistic of the unclipped and clipped objectives. Tokens pushed beyond the trust region
    in the direction their advantage favours (``A > 0, ratio > 1 + high`` or ``A < 0, ratio < 1 - low``)
    take the clipped branch, which is constant in ``logprobs``: they get zero gradient.
    Separate low/high bounds allow asymmetric clipping (e.g. DAPO's "clip-higher").

    Args:
        logprobs: ``[B, T]``.
        old_logprobs: ``[B, T]``.
        advantages: ``[B, T]``.
        loss_mask: ``[B, T]``.
        clip_ratio_low: lower bound of the ratio is ``1 - clip_ratio_low``.
        clip_ratio_high: upper bound of the ratio is ``1 + clip_ratio_high``.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        ``(loss, metrics)`` with metrics, each over masked tokens:
        ``clip_frac`` fraction of tokens where the clipped term is strictly larger (so it is the one
        used); ``approx_kl`` mean of ``0.5 * (logprobs - old_logprobs) ** 2`` (the k2 estimate of the
        KL between old and new policy); ``ratio_mean`` and ``ratio_max`` (0 when no token is masked).
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_agg_mode)
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    loss_mat, clip_active = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    loss = aggregate(loss_mat, loss_mask, denominator)
    return loss, _ratio_metrics(log_ratio, ratio, clip_active, loss_mask)


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL").

    PPO's clipped loss, plus a cap for negative advantages::

        loss_t = ppo_clip_loss_t                          if A_t >= 0
        loss_t = min(ppo_clip_loss_t, -A_t * clip_ratio_c) if A_t < 0

    With ``A < 0`` and a large ratio, PPO's pessimistic branch is ``-A * ratio``, unbounded in the
    ratio; one stale, very off-policy token could then dominate the batch. Above ``ratio = c`` the
    loss is the constant ``-A * c`` and the token gets no gradient.

    Args:
        logprobs, old_logprobs, advantages, loss_mask: see the module docstring.
        clip_ratio_low: lower bound of the ratio is ``1 - clip_ratio_low``.
        clip_ratio_high: upper bound of the ratio is ``1 + clip_ratio_high``.
        clip_ratio_c: the cap's ratio; must be > 1 (3.0 in the paper).
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        ``(loss, metrics)``: ``ppo_clip_loss``'s metrics plus ``dual_clip_frac``, the fraction of
        masked tokens where the cap is the one used.

    Raises:
        ValueError: when ``clip_ratio_c <= 1``.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"dual_clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    aggregate = LOSS_AGGREGATIONS.get(loss_agg_mode)
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    ppo_mat, clip_active = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    cap = -advantages * clip_ratio_c
    capped = (advantages < 0) & (cap < ppo_mat)
    loss_mat = torch.where(capped, cap, ppo_mat)
    loss = aggregate(loss_mat, loss_mask, denominator)
    metrics = _ratio_metrics(log_ratio, ratio, clip_active, loss_mask)
    metrics["dual_clip_frac"] = masked_mean(capped.float(), loss_mask).item()
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level ratio.

    Each sequence ``i`` gets one importance ratio, the geometric mean of its token ratios::

        s_i   = exp(mean_t (logprobs_t - old_logprobs_t))           (masked mean over the response)
        s_i,t = sg[s_i] * exp(logprobs_t - sg[logprobs_t])            (value s_i, gradient per token)

    and ``s_i,t`` replaces the token ratio in PPO's clipped objective. Whole sequences are therefore
    clipped or kept together, which is less noisy than token ratios for long responses (and for MoE
    models whose routing changes between rollout and training). GSPO's own recipe uses very small
    ranges (e.g. ``clip_ratio_low=3e-4, clip_ratio_high=4e-4``); set them in the config.

    Args:
        logprobs, old_logprobs, advantages, loss_mask: see the module docstring.
        clip_ratio_low: lower bound of the sequence ratio is ``1 - clip_ratio_low``.
        clip_ratio_high: upper bound of the sequence ratio is ``1 + clip_ratio_high``.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        ``(loss, metrics)``: ``clip_frac`` counts the tokens of sequences whose ratio is clipped;
        ``ratio_mean`` / ``ratio_max`` are over the sequence ratios ``s_i`` broadcast to their tokens;
        ``approx_kl`` is the per-token k2 estimate, as in ``ppo_clip_loss``.
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_agg_mode)
    token_log_ratio = _log_ratio(logprobs, old_logprobs)
    # From the clamped token log-ratios, so a corrupted padding logprob cannot turn into inf * 0 = NaN.
    seq_log_ratio = masked_mean(token_log_ratio.detach(), loss_mask, dim=-1)
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach())
    loss_mat, clip_active = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    loss = aggregate(loss_mat, loss_mask, denominator)
    return loss, _ratio_metrics(token_log_ratio, ratio, clip_active, loss_mask)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax 2025, "MiniMax-M1"): REINFORCE weighted by a clipped, stop-gradient ratio.

    ::

        loss_t = -sg[clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_t * logprobs_t

    PPO drops the gradient of tokens whose ratio left the trust region; rare but important tokens
    (e.g. "wait" before a correction) are often exactly those. CISPO clips the *weight* instead, so
    every token keeps a gradient, of bounded size. MiniMax-M1 bounded only the upper side (a large
    ``clip_ratio_low`` disables the lower bound).

    Args:
        logprobs, old_logprobs, advantages, loss_mask: see the module docstring.
        clip_ratio_low: the weight is at least ``1 - clip_ratio_low``.
        clip_ratio_high: the weight is at most ``1 + clip_ratio_high``.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        ``(loss, metrics)``: ``clip_frac`` is the fraction of masked tokens whose weight was changed
        by the clamp; the other metrics as in ``ppo_clip_loss``.
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_agg_mode)
    log_ratio = _log_ratio(logprobs, old_logprobs).detach()
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(min=1.0 - clip_ratio_low, max=1.0 + clip_ratio_high)
    loss_mat = -weight * advantages * logprobs
    loss = aggregate(loss_mat, loss_mask, denominator)
    return loss, _ratio_metrics(log_ratio, ratio, weight != ratio, loss_mask)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_range_value: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value (critic) loss.

    ::

        V_clipped = old_V + clip(V - old_V, -c, c)
        loss_t    = 0.5 * max((V - R) ** 2, (V_clipped - R) ** 2)

    The clip keeps the critic from moving far from the values the advantages were computed with;
    ``c <= 0`` disables it (``loss_t = 0.5 * (V - R) ** 2``).

    Args:
        values: ``[B, T]`` current critic values (carries the gradient).
        old_values: ``[B, T]`` critic values at rollout time.
        returns: ``[B, T]`` targets, e.g. from the ``gae`` estimator.
        loss_mask: ``[B, T]``.
        clip_range_value: ``c`` above.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        ``(loss, metrics)`` with, over masked tokens: ``vf_clip_frac`` the fraction where the clipped
        term is strictly larger (so it is used); ``values_mean``; ``explained_variance``
        ``1 - Var(R - V) / Var(R)`` (1 for a perfect critic, 0 when ``Var(R) == 0``).
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_agg_mode)
    unclipped = 0.5 * (values - returns) ** 2
    if clip_range_value > 0:
        clipped_values = old_values + (values - old_values).clamp(min=-clip_range_value, max=clip_range_value)
        clipped = 0.5 * (clipped_values - returns) ** 2
        clip_active = clipped > unclipped
        loss_mat = torch.where(clip_active, clipped, unclipped)
    else:
        clip_active = torch.zeros_like(unclipped, dtype=torch.bool)
        loss_mat = unclipped
    loss = aggregate(loss_mat, loss_mask, denominator)

    with torch.no_grad():
        v, r = values.detach().float(), returns.detach().float()
        var_returns = masked_var(r, loss_mask)
        var_error = masked_var(r - v, loss_mask)
        explained = torch.where(
            var_returns > 0, 1.0 - var_error / var_returns.clamp(min=1e-12), torch.zeros_like(var_returns)
        )
        metrics = {
            "vf_clip_frac": masked_mean(clip_active.float(), loss_mask).item(),
            "values_mean": masked_mean(v, loss_mask).item(),
            "explained_variance": explained.item(),
        }
    return loss, metrics


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS) weights for the rollout engine / trainer mismatch.

    The inference engine (vLLM, SGLang) samples with log-probabilities that differ slightly from the
    trainer's for the same weights (kernels, precision), so the data is mildly off-policy. Yao et al.
    2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training") correct for it
    with::

        w_t = min(exp(old_logprobs_t - rollout_logprobs_t), cap)

    The caller multiplies the advantages by ``w``. Every built-in policy loss is linear in the
    advantage with a positive per-token weight, so this equals weighting each token's loss (and
    gradient) by ``w_t``.

    Args:
        old_logprobs: ``[B, T]`` trainer log-probabilities of the sampled tokens before the update.
        rollout_logprobs: ``[B, T]`` the inference engine's log-probabilities of the same tokens.
        loss_mask: ``[B, T]``.
        cap: truncation, >= 1 (e.g. 2.0).

    Returns:
        ``(weights, metrics)``: ``[B, T]`` float32 weights without gradient, 0 outside the mask;
        ``tis_weight_mean`` (over masked tokens) and ``tis_clip_frac`` (fraction of masked tokens
        whose raw ratio exceeded ``cap``).

    Raises:
        ValueError: when ``cap < 1``.
    """
    if not cap >= 1.0:
        raise ValueError(f"truncated importance sampling cap must be >= 1, got {cap}")
    ratio = torch.exp(_log_ratio(old_logprobs.float(), rollout_logprobs.float()))
    weights = ratio.clamp(max=cap) * loss_mask.to(torch.float32)
    metrics = {
        "tis_weight_mean": masked_mean(weights, loss_mask).item(),
        "tis_clip_frac": masked_mean((ratio > cap).float(), loss_mask).item(),
    }
    return weights, metrics


def kl_penalty_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> torch.Tensor:
    """Aggregated per-token KL(pi || ref) estimate, to add to the loss as ``kl_coef * kl``.

    Args:
        logprobs: ``[B, T]`` policy log-probabilities (carries the gradient).
        ref_logprobs: ``[B, T]`` reference-model log-probabilities.
        loss_mask: ``[B, T]``.
        estimator: ``KL_ESTIMATORS`` name.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        Scalar tensor.
    """
    kl = KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
    return LOSS_AGGREGATIONS.get(loss_agg_mode)(kl, loss_mask, denominator)


def entropy_loss(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> torch.Tensor:
    """Aggregated policy entropy; the caller subtracts ``entropy_coef * entropy_loss(...)``.

    Args:
        entropy: ``[B, T]`` per-token entropy (see ``functional.entropy_from_logits``).
        loss_mask: ``[B, T]``.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        Scalar tensor (the aggregated entropy, a quantity to maximise).
    """
    return LOSS_AGGREGATIONS.get(loss_agg_mode)(entropy, loss_mask, denominator)
