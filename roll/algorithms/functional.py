"""Masked reductions and logit helpers shared by the advantage estimators and losses.

Every function here is pure: tensors in, tensors out, no state. Masks may be bool or float; a float
mask is used as a weight (1 = counts, 0 = padding or environment tokens).
"""

from __future__ import annotations

import torch

Dim = int | tuple[int, ...] | None

# Rows of flattened logits processed at once by the logit helpers: bounds the float32 temporaries
# (rows x vocab) that log-softmax needs, which for a 150k vocabulary would otherwise be gigabytes.
_LOGIT_CHUNK_ROWS = 1024


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


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of ``logits``.

    Computed as ``logit[label] - logsumexp(logits)`` in float32, in chunks of rows, so neither a full
    ``log_softmax`` tensor nor a full float32 copy of half-precision logits is materialised at once.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.
        labels: ``[B, T]`` (the leading shape of ``logits``), integer ids in ``[0, V)``. Positions
            to ignore must still hold a valid id (e.g. the pad id); mask their result afterwards.

    Returns:
        ``[B, T]`` float32 log-probabilities; differentiable with respect to ``logits``.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1)
    chunks = []
    for start in range(0, flat_logits.shape[0], _LOGIT_CHUNK_ROWS):
        rows = flat_logits[start : start + _LOGIT_CHUNK_ROWS].float()
        ids = flat_labels[start : start + _LOGIT_CHUNK_ROWS]
        picked = rows.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        chunks.append(picked - torch.logsumexp(rows, dim=-1))
    if not chunks:
        return flat_logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat(chunks).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which avoids taking ``log`` of tiny
    probabilities. Computed in float32 in chunks of rows, like ``logprobs_from_logits``.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.

    Returns:
        ``[B, T]`` float32 entropies in nats; differentiable with respect to ``logits``.
    """
    vocab = logits.shape[-1]
    lead_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, vocab)
    chunks = []
    for start in range(0, flat_logits.shape[0], _LOGIT_CHUNK_ROWS):
        rows = flat_logits[start : start + _LOGIT_CHUNK_ROWS].float()
        probs = torch.softmax(rows, dim=-1)
        chunks.append(torch.logsumexp(rows, dim=-1) - (probs * rows).sum(dim=-1))
    if not chunks:
        return flat_logits.new_zeros(lead_shape, dtype=torch.float32)
    return torch.cat(chunks).reshape(lead_shape)
