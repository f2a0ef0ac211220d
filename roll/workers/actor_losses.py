"""What the actor trains on: one loss per kind of pipeline, chosen by the spec the pipeline puts in
``ActorSpec.loss``.

- ``PolicyLossSpec`` (RLVR, agentic, on-policy distillation): the registered policy loss, with the entropy
  bonus and the KL term; its denominator counts as ``loss_agg_mode`` says.
- ``CrossEntropySpec`` (SFT, the RL warm start): cross-entropy of the trained tokens, token-mean.
- ``PreferenceLossSpec`` (DPO): the weighted preference losses, a mean over pairs.
- ``DistillLossSpec`` (offline distillation): the divergence from the teacher (plus cross-entropy),
  token-mean.

Each loss is a function of the model and one micro-batch that returns the micro-batch's share of the
loss, already divided by ``denominator`` (the whole mini-batch's count over every rank, so micro-batches
and ranks add up to the big-batch gradient), and its metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch

from roll.algorithms.functional import masked_mean
from roll.data.batch import Batch
from roll.data.masks import loss_mask
from roll.strategies.hf_forward import (
    pad_columns,
    pair_logprobs,
    response_logits,
    response_logprobs,
    response_scores,
)

Loss = tuple[torch.Tensor, dict[str, float]]


@dataclass(frozen=True)
class PolicyLossSpec:
    """What the actor's loss needs of the ``algorithm`` section; fields named as there (``from_section``).

    ``tis_cap`` is resolved by the pipeline: the cap when the off-policy correction is on
    (``roll.config.rlvr.off_policy_corrected``), None when it is off."""

    policy_loss: str = "ppo_clip"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    tis_cap: float | None = None
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class CrossEntropySpec:
    """Supervised fine-tuning: token-mean cross-entropy of the trained response tokens (``loss_mask``)."""

    loss_agg_mode: ClassVar[str] = "token-mean"


@dataclass(frozen=True)
class PreferenceLossSpec:
    """The ``dpo`` section as the actor's preference loss reads it (``from_section``). The loss is a mean
    over the pairs of the whole batch."""

    beta: float = 0.1
    losses: dict[str, float] = field(default_factory=lambda: {"sigmoid": 1.0})
    label_smoothing: float = 0.0
    loss_agg_mode: ClassVar[str] = "seq-mean-token-sum"


@dataclass(frozen=True)
class DistillLossSpec:
    """The ``distill`` section as the student's loss reads it (``from_section``): the divergence per
    trained token, token-mean, plus ``ce_weight`` x the cross-entropy."""

    objective: str = "forward_kl"
    beta: float = 0.5
    tail: str = "extra_class"
    ce_weight: float = 0.0
    loss_agg_mode: ClassVar[str] = "token-mean"


LossSpec = PolicyLossSpec | CrossEntropySpec | PreferenceLossSpec | DistillLossSpec


def policy_loss(
    model: torch.nn.Module,
    micro: Batch,
    denominator: float,
    spec: PolicyLossSpec,
    temperature: float = 1.0,
    kl_coef: float = 0.0,
) -> Loss:
    """The policy loss (plus the entropy bonus and the KL penalty when configured). Needs ``advantages``;
    uses ``old_logprobs`` when present, else the current logprobs detached (exact when each batch gets a
    single optimizer step, and saves a forward pass); ``ref_logprobs`` when ``kl_coef > 0``;
    ``rollout_logprobs`` when the off-policy correction is on (``tis_cap``), and for ``engine_mismatch``
    whenever the batch has them."""
    from roll.algorithms import POLICY_LOSSES
    from roll.algorithms.losses import entropy_loss, kl_penalty_loss, truncated_is_weights
    from roll.utils.registry import accepted_kwargs

    mask = loss_mask(micro).float()
    logprobs, entropy = response_logprobs(model, micro, temperature, with_entropy=True)
    old = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()
    advantages = micro["advantages"]
    metrics: dict[str, float] = {}
    if "rollout_logprobs" in micro:
        staleness = micro["rollout_staleness"] if "rollout_staleness" in micro else None
        metrics.update(engine_mismatch(old, micro["rollout_logprobs"], mask, staleness))
    if spec.tis_cap is not None:
        weights, tis_metrics = truncated_is_weights(old, micro["rollout_logprobs"], mask, spec.tis_cap)
        metrics.update(tis_metrics)
        advantages = advantages * weights
    agg = {"loss_agg_mode": spec.loss_agg_mode, "denominator": denominator}
    loss_fn = POLICY_LOSSES.get(spec.policy_loss)
    params = {
        "clip_ratio_low": spec.clip_ratio_low,
        "clip_ratio_high": spec.clip_ratio_high,
        "clip_ratio_c": spec.clip_ratio_c,
    }
    loss, loss_metrics = loss_fn(logprobs, old, advantages, mask, **agg, **accepted_kwargs(loss_fn, params))
    metrics.update(loss_metrics)
    # Entropy is always reported; it only carries a gradient when it is part of the loss.
    entropy_term = entropy_loss(entropy if spec.entropy_coef else entropy.detach(), mask, **agg)
    if spec.entropy_coef:
        loss = loss - spec.entropy_coef * entropy_term
    if kl_coef:
        kl = kl_penalty_loss(logprobs, micro["ref_logprobs"], mask, estimator=spec.kl_estimator, **agg)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.item()
    return loss, {**metrics, "entropy": entropy_term.item(), "loss": loss.item()}


MISMATCH_METRICS = ("logprob_diff_mean", "logprob_diff_max", "logprob_diff_current_max")


@torch.no_grad()
def engine_mismatch(
    trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor | None = None
) -> dict[str, float]:
    """How far the rollout engine's logprobs of the sampled tokens are from the trainer's before the
    update: ``logprob_diff_mean`` and ``logprob_diff_max`` of ``|engine - trainer|`` over the trained
    tokens. Kernels and precision make it nonzero even for the same weights; a run whose mismatch grows is
    drifting off-policy (in asynchronous training it also holds the policy's lag). With the rows'
    ``staleness`` (versions behind the trained weights), ``logprob_diff_current_max`` is the largest over
    the rows sampled entirely by the trained weights: what remains without lag (stale KV would show
    here), when there are such rows."""
    diff = (engine.float() - trainer.float()).abs()
    kept = mask.bool()
    metrics = {
        "logprob_diff_mean": masked_mean(diff, mask).item(),
        "logprob_diff_max": diff[kept].max().item() if kept.any() else 0.0,
    }
    if staleness is not None:
        current = kept & (staleness == 0).unsqueeze(1)
        if current.any():
            metrics["logprob_diff_current_max"] = diff[current].max().item()
    return metrics


def cross_entropy(model: torch.nn.Module, micro: Batch, denominator: float, spec: CrossEntropySpec) -> Loss:
    logprobs, _ = response_logprobs(model, micro)
    loss = -(logprobs * loss_mask(micro)).sum() / denominator
    return loss, {"loss": loss.item()}


def preference_loss(
    model: torch.nn.Module, micro: Batch, denominator: float, spec: PreferenceLossSpec
) -> Loss:
    """Needs the reference's ``ref_chosen_logps`` and ``ref_rejected_logps`` per pair."""
    from roll.algorithms.preference import PairLogps, combined_preference_loss, preference_metrics

    chosen, rejected, chosen_tokens, rejected_tokens = pair_logprobs(model, micro)
    logps = PairLogps(
        policy_chosen=chosen,
        policy_rejected=rejected,
        reference_chosen=micro["ref_chosen_logps"].to(chosen.dtype),
        reference_rejected=micro["ref_rejected_logps"].to(chosen.dtype),
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )
    per_pair, terms = combined_preference_loss(
        logps, spec.losses, beta=spec.beta, label_smoothing=spec.label_smoothing
    )
    loss = per_pair.sum() / denominator
    return loss, {**terms, **preference_metrics(logps, spec.beta), "loss": loss.item()}


def distill_loss(model: torch.nn.Module, micro: Batch, denominator: float, spec: DistillLossSpec) -> Loss:
    """Needs the teacher's ``teacher_indices`` and ``teacher_logprobs`` at each response position."""
    divergence, kl, logprobs, _ = distill_terms(model, micro, spec)
    divergence_term = divergence.sum() / denominator
    cross_entropy_term = -logprobs.sum() / denominator
    loss = divergence_term + spec.ce_weight * cross_entropy_term if spec.ce_weight else divergence_term
    return loss, {
        "divergence": divergence_term.item(),
        "cross_entropy": cross_entropy_term.item(),
        "teacher_kl": (kl.sum() / denominator).item(),
        "loss": loss.item(),
    }


def distill_terms(
    model: torch.nn.Module, micro: Batch, spec: DistillLossSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per trained token [B, R]: the configured divergence, the forward KL to the teacher, the response
    tokens' logprobs; and the loss mask."""
    from roll.algorithms.distillation import DISTILL_OBJECTIVES, forward_kl, student_on_support
    from roll.algorithms.functional import logprobs_from_logits

    indices = micro["teacher_indices"].long()
    streamed = response_scores(model, micro, partial(_support_and_logprob, tail=spec.tail), indices)
    if streamed is not None:  # the head streamed: no logits for all positions, nor their gradient
        student, logprobs = streamed[..., :-1], streamed[..., -1]
    else:  # no float32 copy of the logits: the support and the logprobs upcast a chunk of rows at a time
        logits, response_ids = response_logits(model, micro)
        width = indices.shape[1]
        student = pad_columns(student_on_support(logits, indices[:, : logits.shape[1]], spec.tail), width)
        logprobs = pad_columns(logprobs_from_logits(logits, response_ids), width)
    teacher = micro["teacher_logprobs"].float()
    divergence = DISTILL_OBJECTIVES.get(spec.objective)(teacher, student, beta=spec.beta)
    mask = loss_mask(micro).float()
    # Zero where not trained: padding positions hold zeros, which are no distribution.
    keep = mask.bool()
    divergence = torch.where(keep, divergence, torch.zeros_like(divergence))
    kl = torch.where(keep, forward_kl(teacher, student), torch.zeros_like(divergence))
    return divergence, kl, logprobs * mask, mask


def _support_and_logprob(
    logits: torch.Tensor, targets: torch.Tensor, indices: torch.Tensor, tail: str
) -> torch.Tensor:
    """A streamed head's score for distillation: the student on the teacher's support, then the
    response token's logprob ([r, S + 1])."""
    from roll.algorithms.distillation import support_logprobs

    picked = logits.gather(-1, targets.unsqueeze(-1)) - torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.cat([support_logprobs(logits, indices, tail), picked], dim=-1)


LOSSES: dict[type, Callable[..., Loss]] = {
    PolicyLossSpec: policy_loss,
    CrossEntropySpec: cross_entropy,
    PreferenceLossSpec: preference_loss,
    DistillLossSpec: distill_loss,
}


def loss_function(spec: Any) -> Callable[..., Loss]:
    """The loss function ``spec`` selects."""
    try:
        return LOSSES[type(spec)]
    except KeyError:
        names = ", ".join(t.__name__ for t in LOSSES)
        raise TypeError(f"ActorSpec.loss must be one of {names} (got {type(spec).__name__})") from None
