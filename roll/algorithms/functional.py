"""Masked reductions and logit helpers shared by the advantage estimators and losses.

Every function here is pure: tensors in, tensors out, no state. Masks may be bool or float; a float
mask is used as a weight (1 = counts, 0 = padding or environment tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Dim = int | tuple[int, ...] | None

# Logits processed at once by the logit helpers (rows x vocab, rounded down to whole rows): bounds the
# float32 temporaries log-softmax needs to about 128 MB each (220 rows of a 152k vocabulary), small
# against the rest of the logprob pass's peak (benchmarks/train_memory.py, docs/performance.md).
_LOGIT_CHUNK_ELEMENTS = 1 << 25


def _as_weight(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bool or float mask -> float weight in the dtype of ``like``."""
    return mask.to(like.dtype) if like.is_floating_point() else mask.to(torch.float32)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set.

    Args:
        values: any shape, e.g. ``[B, T]``.
        mask: same shape as ``values`` (or broadcastable), bool or float.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``values`` summed over ``dim`` with masked-out entries contributing zero.
    """
    weighted = values * _as_weight(mask, values)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Mean of ``values`` over masked entries.

    The denominator (number of masked entries) is clamped to at least 1, so a row or batch with no
    masked entries yields 0 instead of NaN; NaN would poison the whole gradient step.

    Args:
        values: any shape, e.g. ``[B, T]``.
        mask: same shape as ``values`` (or broadcastable), bool or float.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``masked_sum(values, mask, dim) / max(count, 1)``.
    """
    weight = _as_weight(mask, values).expand_as(values)
    count = weight.sum() if dim is None else weight.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all masked entries (a scalar).

    Args:
        values: any shape, e.g. ``[B, T]``.
        mask: same shape as ``values``, bool or float.
        unbiased: apply Bessel's correction ``n / (n - 1)`` (skipped when ``n <= 1``).

    Returns:
        Scalar tensor.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = _as_weight(mask, values).expand_as(values).sum()
        # torch.where instead of an `if` on the count: no host-device sync on GPU.
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``values`` to unit variance (and zero mean) using statistics of masked entries only.

    The variance is the unbiased one (Bessel-corrected), matching ``torch.std``'s default.

    Args:
        values: ``[B, T]`` (any shape works).
        mask: same shape, bool or float.
        shift_mean: subtract the mean; ``False`` only rescales, keeping the original mean, which is
            what advantage whitening wants when the sign of the mean carries information.
        eps: added to the variance before the square root.

    Returns:
        Tensor shaped like ``values``. Entries outside the mask are transformed too but carry no
        meaning; multiply by the mask if they must be zero.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def _scaled(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk of logits in float32, divided by ``temperature`` (a new tensor only where needed)."""
    rows = rows.float()
    return rows / temperature if temperature != 1.0 else rows


def _label_logprobs(rows: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = _scaled(rows, temperature)
    return scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def _entropies(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = _scaled(rows, temperature)
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)


def logit_chunk_rows(vocab: int) -> int:
    """Rows of ``[N, vocab]`` logits processed at once: about ``_LOGIT_CHUNK_ELEMENTS`` logits."""
    return max(1, _LOGIT_CHUNK_ELEMENTS // max(1, vocab))


def by_logit_chunks(
    fn: Callable[..., torch.Tensor], flat_logits: torch.Tensor, *per_row: torch.Tensor, **kw: Any
) -> torch.Tensor | None:
    """``fn(chunk, *per_row chunks, **kw)`` over chunks of rows of ``flat_logits [N, V]`` (about
    ``_LOGIT_CHUNK_ELEMENTS`` logits each), concatenated; None for no rows. With gradients, each chunk is
    recomputed in the backward pass: autograd would otherwise keep every chunk's float32 copy, together
    the whole float32 logits that chunking is meant to avoid."""
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled() and flat_logits.requires_grad
    rows = logit_chunk_rows(flat_logits.shape[-1])
    parts = [part.split(rows) for part in (flat_logits, *per_row)]
    out = []
    for chunk in zip(*parts):
        if grad:
            out.append(checkpoint(fn, *chunk, use_reentrant=False, **kw))
        else:
            out.append(fn(*chunk, **kw))
    return torch.cat(out) if out else None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each label under the softmax of ``logits / temperature``.

    Computed as ``logit[label] - logsumexp(logits)`` in float32, in chunks of rows, so neither a full
    ``log_softmax`` tensor nor a full float32 (or temperature-scaled) copy of the logits exists at once,
    in the forward pass or (each chunk recomputed) the backward.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.
        labels: ``[B, T]`` (the leading shape of ``logits``), integer ids in ``[0, V)``. Positions
            to ignore must still hold a valid id (e.g. the pad id); mask their result afterwards.
        temperature: the sampler's; applied to each chunk.

    Returns:
        ``[B, T]`` float32 log-probabilities; differentiable with respect to ``logits``.
    """
    vocab = logits.shape[-1]
    flat = by_logit_chunks(
        _label_logprobs, logits.reshape(-1, vocab), labels.reshape(-1), temperature=temperature
    )
    if flat is None:
        return logits.new_zeros(labels.shape, dtype=torch.float32)
    return flat.reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the softmax distribution of ``logits / temperature`` at each position.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which avoids taking ``log`` of tiny
    probabilities. Computed in float32 in chunks of rows, like ``logprobs_from_logits``.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.
        temperature: applied to each chunk.

    Returns:
        ``[B, T]`` float32 entropies in nats; differentiable with respect to ``logits``.
    """
    vocab = logits.shape[-1]
    flat = by_logit_chunks(_entropies, logits.reshape(-1, vocab), temperature=temperature)
    if flat is None:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return flat.reshape(logits.shape[:-1])
