"""Checks for roll.algorithms.preference: closed forms, gradient directions, and each loss against an
independent scalar computation with the ``math`` module.

Expected numbers are worked out in the comments next to them, not by calling the code under test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from roll.algorithms.preference import (
    PREFERENCE_LOSSES,
    PairLogps,
    combined_preference_loss,
    preference_metrics,
)

LOSS_NAMES = ["hinge", "ipo", "robust", "sft", "sigmoid"]


def close(actual: torch.Tensor | float, expected, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=rtol,
    )


def pairs(
    policy_chosen,
    policy_rejected,
    reference_chosen,
    reference_rejected,
    chosen_tokens=None,
    rejected_tokens=None,
    requires_grad: bool = False,
) -> PairLogps:
    """``PairLogps`` from lists of floats (float32), the policy tensors optionally requiring grad."""

    def t(values, grad: bool = False) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, requires_grad=grad)

    n = len(policy_chosen)
    return PairLogps(
        policy_chosen=t(policy_chosen, requires_grad),
        policy_rejected=t(policy_rejected, requires_grad),
        reference_chosen=t(reference_chosen),
        reference_rejected=t(reference_rejected),
        chosen_tokens=t(chosen_tokens if chosen_tokens is not None else [1.0] * n),
        rejected_tokens=t(rejected_tokens if rejected_tokens is not None else [1.0] * n),
    )


def equal_to_reference(n: int = 5, requires_grad: bool = False) -> PairLogps:
    """Pairs where the policy is the reference, so every margin is exactly 0."""
    chosen = [-3.0 - i for i in range(n)]
    rejected = [-7.5 + 0.5 * i for i in range(n)]
    return pairs(chosen, rejected, chosen, rejected, [4.0] * n, [6.0] * n, requires_grad=requires_grad)


# ------------------------------------------------------------------------------------ closed forms


def test_registry_holds_the_five_losses():
    assert PREFERENCE_LOSSES.names() == LOSS_NAMES


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_sigmoid_and_robust_are_log2_at_margin_zero(ls):
    logps = equal_to_reference()
    # -(1 - ls) log sigmoid(0) - ls log sigmoid(0) = log 2 whatever ls.
    close(PREFERENCE_LOSSES.get("sigmoid")(logps, beta=0.1, label_smoothing=ls), [math.log(2.0)] * 5)
    # ((1 - ls) log 2 - ls log 2) / (1 - 2 ls) = log 2.
    close(PREFERENCE_LOSSES.get("robust")(logps, beta=0.1, label_smoothing=ls), [math.log(2.0)] * 5)


def test_hinge_is_one_at_margin_zero():
    close(PREFERENCE_LOSSES.get("hinge")(equal_to_reference(), beta=0.3), [1.0] * 5)


@pytest.mark.parametrize(("beta", "expected"), [(0.1, 25.0), (0.5, 1.0)])  # (1 / 0.2)^2, (1 / 1)^2
def test_ipo_is_squared_target_at_margin_zero(beta, expected):
    close(PREFERENCE_LOSSES.get("ipo")(equal_to_reference(), beta=beta), [expected] * 5)


def test_sft_is_chosen_nll_per_token():
    logps = pairs([-6.0, -1.0], [-2.0, -3.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0], [1.0, 1.0])
    close(PREFERENCE_LOSSES.get("sft")(logps, beta=0.1), [2.0, 0.25])  # 6 / 3, 1 / 4


def test_margin_properties():
    logps = pairs([-1.0], [-4.0], [-2.0], [-3.5])
    close(logps.chosen_logratio, [1.0])  # -1 - -2
    close(logps.rejected_logratio, [-0.5])  # -4 - -3.5
    close(logps.margin, [1.5])


def test_pairlogps_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same shape"):
        PairLogps(*(torch.zeros(3) for _ in range(5)), torch.zeros(2))


# -------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", ["sigmoid", "hinge", "ipo", "robust"])
def test_gradient_raises_chosen_and_lowers_rejected(name):
    logps = equal_to_reference(requires_grad=True)
    PREFERENCE_LOSSES.get(name)(logps, beta=0.1, label_smoothing=0.1).sum().backward()
    assert (logps.policy_chosen.grad < 0).all()
    assert (logps.policy_rejected.grad > 0).all()


def test_sft_gradient_touches_only_chosen():
    logps = equal_to_reference(requires_grad=True)
    PREFERENCE_LOSSES.get("sft")(logps, beta=0.1).sum().backward()
    close(logps.policy_chosen.grad, [-0.25] * 5)  # d(-x / 4) / dx
    assert logps.policy_rejected.grad is None or (logps.policy_rejected.grad == 0).all()


def test_reference_gets_no_gradient():
    ref = torch.tensor([-2.0, -3.0], requires_grad=True)
    logps = PairLogps(
        policy_chosen=torch.tensor([-1.0, -2.0], requires_grad=True),
        policy_rejected=torch.tensor([-3.0, -1.0], requires_grad=True),
        reference_chosen=ref,
        reference_rejected=torch.tensor([-2.0, -2.0]),
        chosen_tokens=torch.ones(2),
        rejected_tokens=torch.ones(2),
    )
    PREFERENCE_LOSSES.get("sigmoid")(logps, beta=0.1).sum().backward()
    assert ref.grad is None


# ----------------------------------------------------------------- against a scalar math reference


def _logsigmoid(x: float) -> float:
    # Stable both ways: log(1 / (1 + e^-x)).
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference_loss(name: str, pc, pr, rc, rr, nc, beta: float, ls: float) -> float:
    margin = (pc - rc) - (pr - rr)
    z = beta * margin
    if name == "sigmoid":
        return -(1 - ls) * _logsigmoid(z) - ls * _logsigmoid(-z)
    if name == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    if name == "hinge":
        return max(0.0, 1 - z)
    if name == "robust":
        return ((1 - ls) * -_logsigmoid(z) - ls * -_logsigmoid(-z)) / (1 - 2 * ls)
    if name == "sft":
        return -pc / nc
    raise AssertionError(name)


def _random_pairs(seed: int, n: int = 16) -> tuple[PairLogps, list[tuple[float, ...]]]:
    rng = random.Random(seed)
    rows = [
        (
            rng.uniform(-40, -1),
            rng.uniform(-40, -1),
            rng.uniform(-40, -1),
            rng.uniform(-40, -1),
            float(rng.randint(1, 30)),
            float(rng.randint(1, 30)),
        )
        for _ in range(n)
    ]
    logps = pairs(*(list(col) for col in zip(*rows)))
    # The exact values the float32 tensors hold, so the reference sees the same inputs.
    exact = list(
        zip(
            logps.policy_chosen.tolist(),
            logps.policy_rejected.tolist(),
            logps.reference_chosen.tolist(),
            logps.reference_rejected.tolist(),
            logps.chosen_tokens.tolist(),
        )
    )
    return logps, exact


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize(("beta", "ls"), [(0.1, 0.0), (0.5, 0.2), (2.0, 0.4)])
def test_loss_matches_scalar_reference(name, beta, ls):
    logps, rows = _random_pairs(seed=LOSS_NAMES.index(name))
    expected = [_reference_loss(name, *row, beta=beta, ls=ls) for row in rows]
    actual = PREFERENCE_LOSSES.get(name)(logps, beta=beta, label_smoothing=ls)
    assert actual.shape == (16,)
    close(actual, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------- combined


def test_combined_is_weighted_sum_with_term_metrics():
    logps, rows = _random_pairs(seed=7, n=6)
    total, metrics = combined_preference_loss(logps, {"sigmoid": 1.0, "sft": 0.5}, beta=0.1)
    sigmoid = [_reference_loss("sigmoid", *row, beta=0.1, ls=0.0) for row in rows]
    sft = [_reference_loss("sft", *row, beta=0.1, ls=0.0) for row in rows]
    close(total, [a + 0.5 * b for a, b in zip(sigmoid, sft)], atol=1e-5)
    assert set(metrics) == {"loss/sigmoid", "loss/sft"}
    assert all(type(v) is float for v in metrics.values())
    close(metrics["loss/sigmoid"], sum(sigmoid) / 6, atol=1e-5)
    close(metrics["loss/sft"], sum(sft) / 6, atol=1e-5)


def test_combined_keeps_the_gradient():
    logps = equal_to_reference(requires_grad=True)
    total, _ = combined_preference_loss(logps, {"sigmoid": 1.0, "sft": 0.5}, beta=0.1)
    total.sum().backward()
    # sigmoid at margin 0: -beta / 2 = -0.05; sft: -0.5 / 4 = -0.125.
    close(logps.policy_chosen.grad, [-0.175] * 5)
    close(logps.policy_rejected.grad, [0.05] * 5)


def test_combined_unknown_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="sigmoid"):
        combined_preference_loss(equal_to_reference(), {"sigmod": 1.0}, beta=0.1)


def test_combined_needs_a_loss():
    with pytest.raises(ValueError, match="at least one"):
        combined_preference_loss(equal_to_reference(), {}, beta=0.1)


# ---------------------------------------------------------------------------------------- metrics


def test_preference_metrics_by_hand():
    # beta = 0.5.  chosen logratio / rejected logratio -> rewards (x beta):
    #   pair 1: -1 - -2 = 1,  -3 - -2 = -1     -> 0.5,  -0.5   chosen wins
    #   pair 2: -4 - -3 = -1, -2 - -2.5 = 0.5  -> -0.5,  0.25  rejected wins
    #   pair 3: -1 - -2 = 1,  -4 - -5 = 1      -> 0.5,   0.5   tie: not accurate
    logps = pairs([-1.0, -4.0, -1.0], [-3.0, -2.0, -4.0], [-2.0, -3.0, -2.0], [-2.0, -2.5, -5.0])
    metrics = preference_metrics(logps, beta=0.5)
    assert all(type(v) is float for v in metrics.values())
    close(metrics["rewards/chosen"], 0.5 / 3)  # (0.5 - 0.5 + 0.5) / 3
    close(metrics["rewards/rejected"], 0.25 / 3)  # (-0.5 + 0.25 + 0.5) / 3
    close(metrics["rewards/accuracies"], 1 / 3)
    close(metrics["rewards/margins"], 0.25 / 3)  # (1 - 0.75 + 0) / 3
    close(metrics["logps/chosen"], -2.0)  # (-1 - 4 - 1) / 3
    close(metrics["logps/rejected"], -3.0)  # (-3 - 2 - 4) / 3
    assert set(metrics) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }


# ------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("ls", [0.5, 0.7])
def test_robust_refuses_half_or_more_label_smoothing(ls):
    with pytest.raises(ValueError, match=r"label_smoothing in \[0, 0\.5\)"):
        PREFERENCE_LOSSES.get("robust")(equal_to_reference(), beta=0.1, label_smoothing=ls)


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "hinge", "robust"])
def test_non_positive_beta_is_refused(name):
    with pytest.raises(ValueError, match="beta must be > 0"):
        PREFERENCE_LOSSES.get(name)(equal_to_reference(), beta=0.0)
