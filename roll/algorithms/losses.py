"""Policy losses and the KL / entropy regularisers that the actor adds to them.

Every policy loss has the signature::

    fn(logprobs, old_logprobs, advantages, response_mask, *,
       clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean", denominator=None)
    -> (loss, metrics)

Args shared by all policy losses:
    logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the policy being trained
        (carries the gradient).
    old_logprobs: ``[B, T]`` the same under the policy that generated the samples (no gradient).
    advantages: ``[B, T]``.
    response_mask: ``[B, T]`` bool or float; 0 for padding and environment tokens.
    loss_agg_mode: name in ``LOSS_AGGREGATIONS``; ``denominator`` is passed through to it.

Returns a scalar loss tensor to minimise and a dict of python floats for logging (computed without
gradient). Add a loss with ``@POLICY_LOSSES.register("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.algorithms.aggregation import LOSS_AGGREGATIONS
from roll.algorithms.functional import masked_mean
from roll.algorithms.kl import KL_ESTIMATORS
from roll.utils.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

# exp(20) ~ 5e8 is far outside any trust region yet finite in float32 and bf16; without the clamp a
# stale or corrupted logprob gives inf * 0 = NaN in the loss.
_LOG_RATIO_CLAMP = 20.0


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
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
        response_mask: ``[B, T]``.
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
    log_ratio = (logprobs - old_logprobs).clamp(min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(min=1.0 - clip_ratio_low, max=1.0 + clip_ratio_high)
    clip_active = clipped > unclipped
    # where() rather than maximum(): on ties maximum() splits the gradient between the two branches,
    # which would halve it at the trust-region boundary.
    loss_mat = torch.where(clip_active, clipped, unclipped)
    loss = aggregate(loss_mat, response_mask, denominator)

    with torch.no_grad():
        mask = response_mask.to(torch.bool)
        ratio_max = ratio[mask].max().item() if mask.any() else 0.0
        metrics = {
            "clip_frac": masked_mean(clip_active.float(), response_mask).item(),
            "approx_kl": masked_mean(0.5 * log_ratio.float() ** 2, response_mask).item(),
            "ratio_mean": masked_mean(ratio.float(), response_mask).item(),
            "ratio_max": ratio_max,
        }
    return loss, metrics


def kl_penalty_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> torch.Tensor:
    """Aggregated per-token KL(pi || ref) estimate, to add to the loss as ``kl_coef * kl``.

    Args:
        logprobs: ``[B, T]`` policy log-probabilities (carries the gradient).
        ref_logprobs: ``[B, T]`` reference-model log-probabilities.
        response_mask: ``[B, T]``.
        estimator: ``KL_ESTIMATORS`` name.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        Scalar tensor.
    """
    kl = KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
    return LOSS_AGGREGATIONS.get(loss_agg_mode)(kl, response_mask, denominator)


def entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
) -> torch.Tensor:
    """Aggregated policy entropy; the caller subtracts ``entropy_coef * entropy_loss(...)``.

    Args:
        entropy: ``[B, T]`` per-token entropy (see ``functional.entropy_from_logits``).
        response_mask: ``[B, T]``.
        loss_agg_mode: ``LOSS_AGGREGATIONS`` name.
        denominator: see ``roll.algorithms.aggregation``.

    Returns:
        Scalar tensor (the aggregated entropy, a quantity to maximise).
    """
    return LOSS_AGGREGATIONS.get(loss_agg_mode)(entropy, response_mask, denominator)
