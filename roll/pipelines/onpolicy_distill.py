"""On-policy distillation inside RLVR: which teacher scores each sample, and the advantages and metrics
its log-probabilities give. Glue between ``OnPolicyDistillConfig`` and ``roll.algorithms.distillation``;
no Ray."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from roll.algorithms.distillation import distillation_advantages
from roll.algorithms.functional import masked_mean
from roll.config.devices import TEACHER_PREFIX
from roll.config.rlvr import OnPolicyDistillConfig
from roll.data.batch import Batch

DOMAIN = "domain"  # route_by this: the row's domain (a multi-domain run's, or the single domain's name)


def onpolicy_teachers(cfg: Any) -> dict[str, Any]:
    """An RL config's on-policy distillation teachers by name (none without a ``distill`` section)."""
    distill = getattr(cfg, "distill", None)
    return dict(distill.teachers) if isinstance(distill, OnPolicyDistillConfig) else {}


def row_tag(route_by: str, sample: dict, domain: str) -> str:
    """The value of ``route_by`` for one row: its domain, or the row's field of that name, as text."""
    return domain if route_by == DOMAIN else str(sample.get(route_by))


def row_teachers(batch: Batch, distill: OnPolicyDistillConfig) -> list[str]:
    """The teacher (a key of ``distill.teachers``) that scores each row of ``batch``."""
    if distill.route_by is None:
        return [next(iter(distill.teachers))] * len(batch)
    return [row_tag(distill.route_by, s, d) for s, d in zip(batch["sample"], batch[DOMAIN], strict=True)]


def unrouted(
    rows: Sequence[dict], domains: Sequence[str], distill: OnPolicyDistillConfig
) -> tuple[int, str] | None:
    """The first row (index, tag) whose tag names no teacher, or None when every row has one."""
    if distill.route_by is None:
        return None
    for index, (row, domain) in enumerate(zip(rows, domains, strict=True)):
        tag = row_tag(distill.route_by, row, domain)
        if tag not in distill.teachers:
            return index, tag
    return None


def teacher_role(name: str) -> str:
    return f"{TEACHER_PREFIX}{name}"


def distill_advantages(
    distill: OnPolicyDistillConfig,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    tags: Sequence[str],
    real: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """[B, T] advantages ``-coef * (log pi - log pi_teacher)`` (discounted by ``gamma``), and the per-token
    reverse-KL estimate ``distill/teacher_kl`` over the real rows, per teacher tag too when routed."""
    advantages = distillation_advantages(
        student_logprobs, teacher_logprobs, loss_mask, distill.coef, distill.gamma
    )
    gap = student_logprobs - teacher_logprobs
    mask = loss_mask.float() * real.float().unsqueeze(-1)
    metrics = {"distill/teacher_kl": masked_mean(gap, mask).item()}
    if distill.route_by is not None:
        for tag in dict.fromkeys(tags):
            rows = torch.tensor([t == tag for t in tags])
            metrics[f"distill/{tag}/teacher_kl"] = masked_mean(gap, mask * rows.float().unsqueeze(-1)).item()
    return advantages, metrics


def teacher_advantages(
    distill: OnPolicyDistillConfig,
    batch: Batch,
    loss_mask: torch.Tensor,
    real: torch.Tensor,
    teacher_logprobs: Callable[[str, Batch], torch.Tensor],
    ranks: Callable[[str], int],
) -> tuple[torch.Tensor, dict[str, Any]]:
    """On-policy distillation's advantages and metrics: each row's teacher (``row_teachers``) scores the
    sampled tokens, ``teacher_logprobs(role, rows)`` on that teacher's workers (the rows padded to a
    multiple of its ``ranks(role)``); the policy's own logprobs of them are the old policy's when computed,
    else the engine's (``distill_advantages``)."""
    tags = row_teachers(batch, distill)
    scored = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    tensors = batch.select_keys(batch.tensors)
    for name in dict.fromkeys(tags):
        role, rows = teacher_role(name), [i for i, tag in enumerate(tags) if tag == name]
        part, _ = tensors.select(rows).pad_to_divisor(ranks(role))
        scored[rows] = teacher_logprobs(role, part)[: len(rows)].to(torch.float32)
    student = batch["old_logprobs"] if "old_logprobs" in batch else batch["rollout_logprobs"]
    return distill_advantages(distill, student.to(torch.float32), scored, loss_mask, tags, real)
