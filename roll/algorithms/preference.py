"""Offline preference losses of the DPO family, on the sequence log-probabilities of preference pairs.

Each pair is a prompt with a chosen (preferred) and a rejected completion. The losses see only four
numbers per pair, the summed log-probabilities of each completion under the policy being trained and
under a frozen reference policy, gathered in ``PairLogps``. Every loss has the signature::

    fn(logps: PairLogps, *, beta: float, label_smoothing: float = 0.0) -> loss  # [B], per pair

and every loss accepts both keywords, even one it does not read, so the caller passes the same two to
whichever losses the config names. Losses are not reduced: the caller averages over pairs (and across
data-parallel ranks). ``combined_preference_loss`` sums several weighted losses (e.g. RPO is
``{"sigmoid": 1.0, "sft": alpha}``). Add a loss with ``@PREFERENCE_LOSSES.register("name")``.

``beta``: DPO's implicit reward of a completion ``y`` is ``beta * log(pi(y|x) / pi_ref(y|x))``, and
``beta`` is its inverse temperature, the strength of the KL tie between the policy and the reference
(DPO is the closed-form solution of reward maximisation under a ``beta``-weighted KL penalty). A small
``beta`` lets the policy move far from the reference before the loss saturates; a large one keeps it
close. 0.1 is the usual value for ``sigmoid``. ``hinge`` stops pushing once ``beta * margin >= 1``, and
``ipo`` pulls the margin towards ``1 / (2 * beta)``, so in both a smaller ``beta`` asks for a larger
log-ratio margin. Every loss here uses the margin of *summed* log-probabilities, so a given ``beta``
means the same thing whichever loss reads it.

``label_smoothing`` (``ls``) is the assumed probability that a pair's preference label is flipped
(cDPO, ``robust``); 0 trusts every label.

``preference_metrics`` gives the usual logging numbers (implicit rewards, accuracy, margins) under the
names TRL uses, so dashboards carry over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from roll.utils.registry import Registry

PreferenceLossFn = Callable[..., torch.Tensor]
PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss")


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 when it already is: bf16 sums of long sequences lose the margin."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# eq=False: the generated __eq__ would compare tensors element-wise and fail on ``bool()``.
@dataclass(frozen=True, eq=False)
class PairLogps:
    """Sequence log-probabilities of ``B`` preference pairs, each field a float tensor ``[B]``.

    Attributes:
        policy_chosen: sum over the chosen completion's trained tokens of ``log pi`` (carries gradient).
        policy_rejected: the same for the rejected completion.
        reference_chosen: the same under the frozen reference policy (no gradient; detached here).
        reference_rejected: the same for the rejected completion.
        chosen_tokens: number of trained tokens of the chosen completion, as float (``>= 1``).
        rejected_tokens: the same for the rejected completion.
    """

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    reference_chosen: torch.Tensor
    reference_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def __post_init__(self) -> None:
        shapes = {f.name: tuple(getattr(self, f.name).shape) for f in fields(self)}
        if len(set(shapes.values())) != 1 or len(shapes["policy_chosen"]) != 1:
            raise ValueError(f"PairLogps fields must all be 1-D tensors of the same shape [B], got {shapes}")

    @property
    def chosen_logratio(self) -> torch.Tensor:
        """``[B]`` ``log pi(chosen) - log pi_ref(chosen)``; the implicit reward divided by beta."""
        return _at_least_float32(self.policy_chosen) - _at_least_float32(self.reference_chosen).detach()

    @property
    def rejected_logratio(self) -> torch.Tensor:
        """``[B]`` ``log pi(rejected) - log pi_ref(rejected)``."""
        return _at_least_float32(self.policy_rejected) - _at_least_float32(self.reference_rejected).detach()

    @property
    def margin(self) -> torch.Tensor:
        """``[B]`` ``chosen_logratio - rejected_logratio``; every DPO-family loss is a function of it."""
        return self.chosen_logratio - self.rejected_logratio


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid_loss(logps: PairLogps, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290), with conservative label smoothing (cDPO).

    ``loss = -(1 - ls) * logsigmoid(beta * margin) - ls * logsigmoid(-beta * margin)``: the negative
    log-likelihood of the preference under a Bradley-Terry model of the implicit rewards; with
    ``ls > 0`` the target is ``1 - ls`` instead of 1, so the loss has a finite minimiser (a margin of
    ``logit(1 - ls) / beta``) instead of pushing the margin to infinity. ``log 2`` at margin 0.

    Args:
        logps: ``B`` pairs.
        beta: inverse temperature of the implicit reward (see the module docstring).
        label_smoothing: probability that a label is flipped, in ``[0, 1]``.

    Returns:
        ``[B]`` per-pair loss.
    """
    _check_beta(beta)
    logits = beta * logps.margin
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(logps: PairLogps, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", arXiv 2310.12036): ``(margin - 1 / (2 * beta)) ** 2``.

    A squared loss that regresses the log-ratio margin onto the target ``1 / (2 * beta)`` rather than
    pushing it without bound, so it does not overfit deterministic preferences. The margin is that of
    *summed* log-probabilities, as in the paper; TRL averages the log-probabilities per token for IPO,
    which changes what a given ``beta`` means. We keep the sum so that ``beta`` means the same in every
    loss of this module (with per-token averages, a target of ``1 / (2 * beta)`` would ask for a margin
    roughly ``length`` times larger). ``label_smoothing`` is not used.

    Args:
        logps: ``B`` pairs.
        beta: the target margin is ``1 / (2 * beta)``.
        label_smoothing: ignored.

    Returns:
        ``[B]`` per-pair loss; ``(1 / (2 * beta)) ** 2`` at margin 0.
    """
    _check_beta(beta)
    return (logps.margin - 1.0 / (2.0 * beta)) ** 2


@PREFERENCE_LOSSES.register("hinge")
def hinge_loss(logps: PairLogps, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SLiC's calibration loss (Zhao et al. 2023, "SLiC-HF", arXiv 2305.10425), on the reference-relative
    margin: ``relu(1 - beta * margin)``.

    Zero (and without gradient) once the margin reaches ``1 / beta``; 1 at margin 0.
    ``label_smoothing`` is not used.

    Args:
        logps: ``B`` pairs.
        beta: the loss vanishes for ``margin >= 1 / beta``.
        label_smoothing: ignored.

    Returns:
        ``[B]`` per-pair loss.
    """
    _check_beta(beta)
    return torch.relu(1.0 - beta * logps.margin)


@PREFERENCE_LOSSES.register("robust")
def robust_loss(logps: PairLogps, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", arXiv 2403.00409).

    ``loss = ((1 - ls) * -logsigmoid(beta * margin) - ls * -logsigmoid(-beta * margin)) / (1 - 2 * ls)``

    An unbiased estimate of the clean-label DPO loss when each label is flipped with probability
    ``ls``: the flipped-label term is *subtracted*, and the division by ``1 - 2 * ls`` restores the
    scale. At ``ls = 0`` it is ``sigmoid``; at ``ls = 0.5`` labels carry no information and the
    estimator is undefined. Unlike cDPO the loss is unbounded below, so ``ls`` should be an honest
    estimate of the noise rate.

    Args:
        logps: ``B`` pairs.
        beta: inverse temperature of the implicit reward.
        label_smoothing: label flip probability, in ``[0, 0.5)``.

    Returns:
        ``[B]`` per-pair loss; ``log 2`` at margin 0 for every ``ls``.

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 0.5)``.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"the robust preference loss needs label_smoothing in [0, 0.5) (it divides by "
            f"1 - 2 * label_smoothing), got {label_smoothing}"
        )
    logits = beta * logps.margin
    clean = -F.logsigmoid(logits)
    flipped = -F.logsigmoid(-logits)
    return ((1.0 - label_smoothing) * clean - label_smoothing * flipped) / (1.0 - 2.0 * label_smoothing)


@PREFERENCE_LOSSES.register("sft")
def sft_loss(logps: PairLogps, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """The chosen completion's negative log-likelihood per token: ``-policy_chosen / chosen_tokens``.

    The extra term of RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization",
    arXiv 2404.19733), added to DPO with a weight (``{"sigmoid": 1.0, "sft": alpha}``). DPO alone can
    lower the chosen completion's likelihood as long as the rejected one falls faster; this term keeps
    the chosen likelihood up. Averaged per token, so long completions do not dominate. Neither ``beta``
    nor ``label_smoothing`` is used; the reference plays no part.

    Args:
        logps: ``B`` pairs.
        beta: ignored.
        label_smoothing: ignored.

    Returns:
        ``[B]`` per-pair loss; no gradient reaches ``policy_rejected``.
    """
    # The clamp only guards a malformed pair with no trained token against 0 / 0.
    tokens = _at_least_float32(logps.chosen_tokens).clamp(min=1.0)
    return -_at_least_float32(logps.policy_chosen) / tokens


def combined_preference_loss(
    logps: PairLogps,
    weights: Mapping[str, float],
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted sum of named ``PREFERENCE_LOSSES``, per pair.

    Args:
        logps: ``B`` pairs.
        weights: loss name -> weight, e.g. ``{"sigmoid": 1.0, "sft": 0.5}`` (RPO). Not empty.
        beta: passed to every loss.
        label_smoothing: passed to every loss.

    Returns:
        ``(loss, metrics)``: ``loss`` is ``[B]``, ``sum_name weight * fn_name(logps)``; ``metrics`` maps
        ``loss/<name>`` to the unweighted term's mean over pairs (python floats, no gradient).

    Raises:
        KeyError: an unknown loss name (the message lists the registered ones), raised before any
            loss is computed.
        ValueError: ``weights`` is empty.
    """
    if not weights:
        raise ValueError("combined_preference_loss needs at least one loss in weights")
    fns = {name: PREFERENCE_LOSSES.get(name) for name in weights}
    total: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    for name, fn in fns.items():
        term = fn(logps, beta=beta, label_smoothing=label_smoothing)
        metrics[f"loss/{name}"] = term.detach().mean().item()
        weighted = weights[name] * term
        total = weighted if total is None else total + weighted
    assert total is not None
    return total, metrics


@torch.no_grad()
def preference_metrics(logps: PairLogps, beta: float) -> dict[str, float]:
    """Logging metrics of ``B`` pairs, as python floats, under TRL's names.

    - ``rewards/chosen``: mean of the chosen implicit reward ``beta * chosen_logratio``.
    - ``rewards/rejected``: mean of ``beta * rejected_logratio``.
    - ``rewards/accuracies``: fraction of pairs whose chosen reward is strictly greater than the
      rejected one (a tie counts as wrong: at initialisation, policy == reference, accuracy is 0).
    - ``rewards/margins``: mean of ``beta * margin``.
    - ``logps/chosen``, ``logps/rejected``: means of the policy's summed log-probabilities.

    Args:
        logps: ``B >= 1`` pairs.
        beta: inverse temperature of the implicit reward.
    """
    chosen = beta * logps.chosen_logratio
    rejected = beta * logps.rejected_logratio
    return {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": (chosen > rejected).float().mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "logps/chosen": _at_least_float32(logps.policy_chosen).mean().item(),
        "logps/rejected": _at_least_float32(logps.policy_rejected).mean().item(),
    }
