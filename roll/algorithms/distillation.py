"""Knowledge distillation: divergences between a teacher and a student next-token distribution, the
top-k compression of the teacher that is cached on disk, and on-policy distillation's advantages.

Conventions: ``p`` is the teacher's distribution, ``q`` the student's.

- forward KL ``KL(p || q) = sum p (log p - log q)``: mode covering, the classic KD loss (Hinton et al.
  2015); the student is penalised wherever the teacher has mass it lacks.
- reverse KL ``KL(q || p)``: mode seeking; the student is penalised for mass where the teacher has
  little. It is infinite where the teacher gives a class probability 0 and the student does not.
- generalized JSD (GKD): interpolates between the two, bounded, see ``generalized_jsd``.

Every divergence takes log-probabilities over the same classes, ``[..., V]`` (the whole vocabulary) or
``[..., S]`` (a top-k support, below), and returns one value per position ``[...]``: no reduction, the
caller masks and aggregates (``roll.algorithms.aggregation``). They compute in float32 (float64 stays
float64) whatever the input dtype, and are written so that a probability of exactly 0 contributes
``0 * log 0 = 0`` to the value and 0 to the gradient, never NaN. Registered in ``DISTILL_OBJECTIVES``
with the signature ``fn(teacher_logprobs, student_logprobs, *, beta=0.5) -> [...]``.

Top-k teacher (``teacher_topk``): storing a teacher's full distribution costs ``V`` floats per token
(150k for Qwen), so only its ``k`` most likely tokens are cached, with one of two ``TAILS``:

- ``renormalize``: the teacher restricted to its top ``k`` tokens and renormalised; the student is
  compared on the same ``k`` tokens, also renormalised (``S = k``). Ignores the tail entirely.
- ``extra_class``: the ``k`` tokens' true probabilities plus one class holding all remaining mass
  (``S = k + 1``), for teacher and student alike. No mass is lost, and with ``k = V`` this is the
  exact dense divergence.

``student_on_support`` maps the student's logits onto the same ``S`` classes, so the cached
``(indices, logprobs)`` is all a loss needs besides the student's own logits.

``distillation_advantages`` is the on-policy (RL) form: the student samples, the teacher scores the
sampled tokens, and the per-token negated reverse KL is the reward of a policy-gradient update.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from roll.algorithms.functional import by_logit_chunks, logit_chunk_rows
from roll.utils.registry import Registry

DistillFn = Callable[..., torch.Tensor]
DISTILL_OBJECTIVES: Registry[DistillFn] = Registry("distillation objective")

TAILS = ("renormalize", "extra_class")


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (float64 stays float64): bf16 log-probabilities lose the KL's small differences."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_tail(tail: str) -> None:
    if tail not in TAILS:
        raise ValueError(f"unknown top-k tail '{tail}'; choose one of {', '.join(TAILS)}")


def _safe_logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``logsumexp`` over ``dim`` that is ``-inf`` with zero gradient for an all ``-inf`` slice.

    ``torch.logsumexp`` returns ``-inf`` there too, but its backward computes ``exp(-inf - -inf)`` =
    NaN. Such slices are swapped for zeros before the call and the result put back to ``-inf``, so
    no NaN is ever formed (the double-``where`` pattern).
    """
    dead = (x == float("-inf")).all(dim=dim, keepdim=True)
    out = torch.logsumexp(torch.where(dead, torch.zeros_like(x), x), dim=dim, keepdim=True)
    return torch.where(dead, torch.full_like(out, float("-inf")), out).squeeze(dim)


def _log_tail_mass(logits: torch.Tensor, indices: torch.Tensor, log_normalizer: torch.Tensor) -> torch.Tensor:
    """``[...]`` log of the probability mass outside ``indices``, ``log(1 - sum_topk p)``.

    Computed as the logsumexp of the other logits minus the log normaliser, not as
    ``log1p(-sum p_topk)``, which cancels catastrophically when the top-k holds almost all the mass
    (the usual case for a confident teacher). ``-inf`` when ``indices`` covers the vocabulary.
    """
    rest = logits.scatter(-1, indices, float("-inf"))  # differentiable; no gradient to the top-k
    return _safe_logsumexp(rest) - log_normalizer


def support_size(k: int, tail: str) -> int:
    """``S``, the classes a top-``k`` distribution has under ``tail``: ``k``, plus one for the extra class."""
    return k if tail == "renormalize" else k + 1


def support_logprobs(logits: torch.Tensor, indices: torch.Tensor, tail: str) -> torch.Tensor:
    """The distribution of ``logits [..., V]`` on ``indices [..., k]`` under ``tail``: ``[..., S]``."""
    _check_tail(tail)
    k, vocab = indices.shape[-1], logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k needs 1 <= k <= vocabulary size {vocab}, got k={k}")
    gathered = logits.gather(-1, indices)
    if tail == "renormalize":
        return torch.log_softmax(gathered, dim=-1)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    top = gathered - log_normalizer.unsqueeze(-1)
    rest = _log_tail_mass(logits, indices, log_normalizer)
    return torch.cat([top, rest.unsqueeze(-1)], dim=-1)


def teacher_topk(teacher_logits: torch.Tensor, k: int, tail: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress the teacher to its ``k`` most likely tokens per position (what gets cached on disk).

    Args:
        teacher_logits: ``[..., V]`` any float dtype (computed in float32). No gradient is taken.
        k: number of tokens kept, ``1 <= k <= V``.
        tail: ``"renormalize"`` or ``"extra_class"`` (see the module docstring).

    Returns:
        ``(indices, logprobs)``: ``indices`` ``[..., k]`` long, the top-k token ids by decreasing
        logit; ``logprobs`` ``[..., S]``:

        - ``renormalize``, ``S = k``: log-softmax over the ``k`` largest logits.
        - ``extra_class``, ``S = k + 1``: the ``k`` tokens' full-softmax log-probabilities, then the
          log of the remaining mass (``-inf`` when ``k == V``).
    """
    _check_tail(tail)
    vocab = teacher_logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k needs 1 <= k <= vocabulary size {vocab}, got k={k}")
    lead = teacher_logits.shape[:-1]
    flat = teacher_logits.detach().reshape(-1, vocab)
    indices, logprobs = [], []
    with torch.no_grad():  # a chunk of positions at a time: no float32 copy of the whole logits
        for chunk in flat.split(logit_chunk_rows(vocab)):
            chunk = _at_least_float32(chunk)
            top = torch.topk(chunk, k, dim=-1).indices
            indices.append(top)
            logprobs.append(support_logprobs(chunk, top, tail))
    width = support_size(k, tail)
    if not indices:
        empty = flat.new_zeros((*lead, k), dtype=torch.long)
        return empty, flat.new_zeros((*lead, width), dtype=torch.float32)
    return torch.cat(indices).reshape(*lead, k), torch.cat(logprobs).reshape(*lead, width)


def student_on_support(student_logits: torch.Tensor, indices: torch.Tensor, tail: str) -> torch.Tensor:
    """The student's distribution over the teacher's cached support, differentiable.

    Computed in float32 a chunk of positions at a time (each recomputed in backward), so no float32
    copy of the whole ``[..., V]`` logits exists, in the forward pass or the backward.

    Args:
        student_logits: ``[..., V]``, any float dtype.
        indices: ``[..., k]`` long, from ``teacher_topk``.
        tail: the tail the teacher was cached with.

    Returns:
        ``[..., S]`` log-probabilities in float32 (float64 stays float64) matching ``teacher_topk``'s:
        ``renormalize`` the log-softmax of the ``k`` gathered logits; ``extra_class`` the ``k`` tokens'
        full-softmax log-probabilities plus the log of the student's mass on every other token.
    """
    _check_tail(tail)
    k, vocab = indices.shape[-1], student_logits.shape[-1]
    lead = indices.shape[:-1]
    flat = by_logit_chunks(
        _student_support, student_logits.reshape(-1, vocab), indices.reshape(-1, k), tail=tail
    )
    width = support_size(k, tail)
    if flat is None:
        return student_logits.new_zeros((*lead, width), dtype=torch.float32)
    return flat.reshape(*lead, width)


def _student_support(rows: torch.Tensor, indices: torch.Tensor, tail: str) -> torch.Tensor:
    return support_logprobs(_at_least_float32(rows), indices, tail)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a || b) = sum a (log a - log b)`` over the last dim, from log-probabilities: ``[...]``.

    Classes with ``a = 0`` (``log a = -inf``, or so negative that ``exp`` underflows) contribute 0:
    both logs are replaced by 0 there before any arithmetic, so neither ``-inf - -inf`` nor
    ``0 * inf`` is formed, and the gradient through the unused branch is exactly 0. Where ``a > 0``
    and ``b = 0`` the value is ``+inf``, which is the true divergence.
    """
    log_a, log_b = _at_least_float32(log_a), _at_least_float32(log_b)
    present = torch.exp(log_a) > 0
    safe_a = torch.where(present, log_a, torch.zeros_like(log_a))
    safe_b = torch.where(present, log_b, torch.zeros_like(log_b))
    terms = torch.exp(safe_a) * (safe_a - safe_b)
    return torch.where(present, terms, torch.zeros_like(terms)).sum(dim=-1)


def forward_kl(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(p_teacher || q_student)``: mode covering, classic knowledge distillation.

    Args:
        teacher_logprobs: ``[..., S]`` log p.
        student_logprobs: ``[..., S]`` log q, over the same classes.

    Returns:
        ``[...]`` non-negative (up to rounding), 0 where the two are equal.
    """
    return _kl(teacher_logprobs, student_logprobs)


def reverse_kl(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(q_student || p_teacher)``: mode seeking; infinite where ``p = 0 < q``.

    Args:
        teacher_logprobs: ``[..., S]`` log p.
        student_logprobs: ``[..., S]`` log q, over the same classes.

    Returns:
        ``[...]``.
    """
    return _kl(student_logprobs, teacher_logprobs)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta * p + (1 - beta) * q)`` computed in log space, ``-inf`` (zero gradient) where both are 0.

    ``beta`` is strictly inside ``(0, 1)`` here, so the mixture is positive wherever ``p`` or ``q`` is.
    """
    a = log_p + math.log(beta)
    b = log_q + math.log(1.0 - beta)
    # logaddexp's backward at (-inf, -inf) is NaN: same double-where as _safe_logsumexp.
    dead = (a == float("-inf")) & (b == float("-inf"))
    zero = torch.zeros_like(a)
    mixed = torch.logaddexp(torch.where(dead, zero, a), torch.where(dead, zero, b))
    return torch.where(dead, torch.full_like(mixed, float("-inf")), mixed)


def generalized_jsd(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, beta: float
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024, "On-Policy Distillation of
    Language Models: Learning from Self-Generated Mistakes", arXiv 2306.13649), rescaled.

    With the mixture ``M = beta * p + (1 - beta) * q``::

        JSD_beta(p, q) = beta * KL(p || M) + (1 - beta) * KL(q || M)

    returned **divided by** ``beta * (1 - beta)``. The paper's ``JSD_beta`` vanishes at both ends
    (``M`` becomes ``q`` or ``p``); the rescaled one is continuous in ``beta`` with the limits
    ``beta -> 0``: ``KL(p || q)`` (forward KL) and ``beta -> 1``: ``KL(q || p)`` (reverse KL), so one
    knob sweeps from mode covering to mode seeking at a comparable scale. At ``beta = 0.5`` it is 4x
    the usual JSD. At exactly 0 and 1 it returns ``forward_kl`` and ``reverse_kl``. Swapping the
    roles mirrors ``beta``: ``generalized_jsd(p, q, b) == generalized_jsd(q, p, 1 - b)``. The mixture
    is formed in log space (``logaddexp(log beta + log p, log(1 - beta) + log q)``); for ``0 < beta < 1``
    the value stays finite even where ``p`` or ``q`` is 0 (unlike either KL).

    Args:
        teacher_logprobs: ``[..., S]`` log p.
        student_logprobs: ``[..., S]`` log q, over the same classes.
        beta: in ``[0, 1]``, the teacher's weight in the mixture.

    Returns:
        ``[...]``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd needs beta in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(teacher_logprobs, student_logprobs)
    if beta == 1.0:
        return reverse_kl(teacher_logprobs, student_logprobs)
    log_p, log_q = _at_least_float32(teacher_logprobs), _at_least_float32(student_logprobs)
    log_m = _log_mixture(log_p, log_q, beta)
    jsd = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return jsd / (beta * (1.0 - beta))


@DISTILL_OBJECTIVES.register("forward_kl")
def forward_kl_objective(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, *, beta: float = 0.5
) -> torch.Tensor:
    """``forward_kl``; ``beta`` is ignored. ``[..., S]`` -> ``[...]``."""
    return forward_kl(teacher_logprobs, student_logprobs)


@DISTILL_OBJECTIVES.register("reverse_kl")
def reverse_kl_objective(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, *, beta: float = 0.5
) -> torch.Tensor:
    """``reverse_kl``; ``beta`` is ignored. ``[..., S]`` -> ``[...]``."""
    return reverse_kl(teacher_logprobs, student_logprobs)


@DISTILL_OBJECTIVES.register("jsd")
def jsd_objective(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, *, beta: float = 0.5
) -> torch.Tensor:
    """``generalized_jsd`` with the teacher's mixture weight ``beta``. ``[..., S]`` -> ``[...]``."""
    return generalized_jsd(teacher_logprobs, student_logprobs, beta)


def distillation_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    gamma: float = 0.0,
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation.

    The student samples a response; the teacher scores the sampled tokens. The per-token reward is
    the negated single-sample estimate of the reverse KL ``KL(q_student || p_teacher)`` on the sampled
    token::

        r_t = -coef * (log q(y_t) - log p(y_t))

    (GKD, Agarwal et al. 2024, arXiv 2306.13649; Thinking Machines, "On-Policy Distillation", Lu et
    al. 2025, which uses ``gamma = 0``). With ``gamma > 0`` each token is also credited with the
    discounted rewards of later trained tokens, since a token also shapes what the student samples
    next::

        A_t = sum over trained k >= t of gamma ** n(t, k) * r_k

    where ``n(t, k)`` counts the trained tokens after ``t`` up to and including ``k``. Tokens outside
    ``loss_mask`` (padding, an environment's observation inside a multi-turn response) earn nothing
    and cost no discount step, so they do not shorten the horizon. ``gamma = 0`` gives ``r_t``
    alone; ``gamma = 1`` the undiscounted reward-to-go.

    Args:
        student_logprobs: ``[B, T]`` log q of the sampled tokens (the sampling policy's; no gradient is
            taken).
        teacher_logprobs: ``[B, T]`` log p of the same tokens.
        loss_mask: ``[B, T]`` bool or float, 1 for trained tokens.
        coef: scale of the reward (the weight of the reverse KL).
        gamma: discount per trained token, in ``[0, 1]``.

    Returns:
        ``[B, T]`` float32 (float64 stays float64), 0 outside ``loss_mask``.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"distillation_advantages needs gamma in [0, 1], got {gamma}")
    with torch.no_grad():
        mask = loss_mask.to(torch.bool)
        student = _at_least_float32(student_logprobs.detach())
        teacher = _at_least_float32(teacher_logprobs.detach())
        # where(), not a product: padding may hold -inf log-probabilities, and -inf * 0 is NaN.
        rewards = torch.where(mask, -coef * (student - teacher), torch.zeros_like(student))
        if gamma == 0.0:
            return rewards
        if gamma == 1.0:
            # Masked positions hold 0, so a reversed cumulative sum is the reward-to-go.
            to_go = rewards.flip(-1).cumsum(-1).flip(-1)
            return torch.where(mask, to_go, torch.zeros_like(to_go))
        out = torch.zeros_like(rewards)
        running = rewards.new_zeros(rewards.shape[:-1])
        for t in reversed(range(rewards.shape[-1])):
            # A masked position neither adds a reward nor applies a discount step.
            running = torch.where(mask[..., t], rewards[..., t] + gamma * running, running)
            out[..., t] = running
        return torch.where(mask, out, torch.zeros_like(out))
