"""Per-token estimators of KL(pi || ref) from tokens sampled from pi.

The exact KL needs the full distributions; with only the log-probabilities of the sampled tokens we
use J. Schulman's Monte-Carlo estimators ("Approximating KL Divergence", 2020). With
``log_r = ref_logprobs - logprobs`` (so ``r = ref(x) / pi(x)`` and ``x ~ pi``):

- ``k1 = -log_r``: unbiased, but single samples can be negative, so the variance is high.
- ``k2 = 0.5 * log_r ** 2``: biased (low bias when pi and ref are close), always >= 0, low variance.
- ``k3 = (r - 1) - log_r``: unbiased (``E[r - 1] = 0``) and always >= 0 because ``log r <= r - 1``;
  usually the best default.
- ``abs = |log_r|``: a non-negative variant of k1.

Every estimator has the signature ``fn(logprobs [B, T], ref_logprobs [B, T]) -> [B, T]`` and works
element-wise, so masking and aggregation are the caller's job (see ``losses.kl_penalty_loss``).
Add one with ``@KL_ESTIMATORS.register("name")``.

``adaptive_kl_coef`` updates the coefficient of a KL penalty between steps (a controller, not an
estimator).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.utils.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")

# k3 grows like exp(ref - logprobs); a token the policy now finds very unlikely relative to ref would
# otherwise produce a huge (or inf) penalty and gradient that swamps the batch.
_K3_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs - ref_logprobs``: unbiased, can be negative per token.

    Args:
        logprobs: ``[B, T]`` log pi of the sampled tokens.
        ref_logprobs: ``[B, T]`` log ref of the same tokens.

    Returns:
        ``[B, T]``.
    """
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logprobs - ref_logprobs) ** 2``: non-negative, biased, low variance.

    Args:
        logprobs: ``[B, T]``.
        ref_logprobs: ``[B, T]``.

    Returns:
        ``[B, T]``.
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``exp(ref - logprobs) - (ref - logprobs) - 1``: unbiased and non-negative.

    The result is clamped to ``[-10, 10]`` for numerical stability (the lower bound never binds since
    k3 >= 0); clamped tokens get zero gradient.

    Args:
        logprobs: ``[B, T]``.
        ref_logprobs: ``[B, T]``.

    Returns:
        ``[B, T]``, 0 where the two log-probabilities are equal.
    """
    log_ratio = ref_logprobs - logprobs
    k3 = torch.exp(log_ratio) - log_ratio - 1
    return k3.clamp(min=-_K3_CLAMP, max=_K3_CLAMP)


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``|logprobs - ref_logprobs|``.

    Args:
        logprobs: ``[B, T]``.
        ref_logprobs: ``[B, T]``.

    Returns:
        ``[B, T]``.
    """
    return (logprobs - ref_logprobs).abs()


def adaptive_kl_coef(
    coef: float, observed_kl: float, target_kl: float, horizon: int, batch_size: int
) -> float:
    """One update of the adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models
    from Human Preferences").

    A proportional controller that steers the observed KL(pi || ref) towards ``target_kl``::

        error = clip(observed_kl / target_kl - 1, -0.2, 0.2)
        coef  = coef * (1 + error * batch_size / horizon)

    The clip bounds how much one noisy batch can move the coefficient; ``horizon`` (in samples) sets
    how fast it reacts: after ``horizon`` samples with a constant error the coefficient has changed by
    about a factor ``exp(error)``.

    Args:
        coef: current KL coefficient.
        observed_kl: KL measured on the last batch (e.g. the mean per-sequence KL).
        target_kl: desired KL, > 0.
        horizon: reaction time in samples, > 0.
        batch_size: samples in the last batch.

    Returns:
        The new coefficient.

    Raises:
        ValueError: when ``target_kl <= 0`` or ``horizon <= 0``.
    """
    if not target_kl > 0:
        raise ValueError(f"adaptive KL needs target_kl > 0, got {target_kl}")
    if not horizon > 0:
        raise ValueError(f"adaptive KL needs horizon > 0, got {horizon}")
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * batch_size / horizon)
