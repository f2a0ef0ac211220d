"""Checks for roll.algorithms.distillation: divergences against dense and scalar references, the top-k
tails, the generalized JSD's limits, finiteness at zero probabilities and with peaked logits, and the
on-policy distillation advantages on a hand-worked example.

Expected numbers are worked out in the comments next to them, not by calling the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from roll.algorithms.distillation import (
    DISTILL_OBJECTIVES,
    TAILS,
    distillation_advantages,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    student_on_support,
    teacher_topk,
)

V = 7
OBJECTIVES = ["forward_kl", "jsd", "reverse_kl"]


def close(actual, expected, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=rtol,
    )


def logits(seed: int, shape=(2, 3, V), scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def dense_kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) straight from the definition, for full-support distributions."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def on_support(teacher: torch.Tensor, student: torch.Tensor, k: int, tail: str):
    indices, t = teacher_topk(teacher, k, tail)
    return t, student_on_support(student, indices, tail)


# ------------------------------------------------------------------------------------------ basics


def test_registry_and_tails():
    assert DISTILL_OBJECTIVES.names() == OBJECTIVES
    assert TAILS == ("renormalize", "extra_class")


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("k", [3, V])
def test_identical_teacher_and_student_give_zero(tail, k):
    x = logits(0)
    t, s = on_support(x, x.clone(), k, tail)
    assert t.shape == s.shape == (2, 3, k + (tail == "extra_class"))
    for name in OBJECTIVES:
        for beta in (0.1, 0.5, 0.9):
            value = DISTILL_OBJECTIVES.get(name)(t, s, beta=beta)
            assert value.shape == (2, 3)
            close(value, torch.zeros(2, 3), atol=1e-6)


def test_identical_logprobs_give_zero_advantages():
    lp = -torch.rand(4, 6)
    mask = torch.ones(4, 6)
    for gamma in (0.0, 0.5, 1.0):
        close(distillation_advantages(lp, lp.clone(), mask, coef=1.0, gamma=gamma), torch.zeros(4, 6))


def test_teacher_topk_indices_and_no_gradient():
    x = torch.tensor([[0.5, 3.0, -1.0, 2.0]], requires_grad=True)
    indices, lp = teacher_topk(x, 2, "renormalize")
    assert indices.dtype == torch.long
    assert indices.tolist() == [[1, 3]]  # logits 3.0 then 2.0
    assert not lp.requires_grad


# ------------------------------------------------------------------------------ against dense KLs


@pytest.mark.parametrize("tail", TAILS)
def test_full_vocabulary_topk_is_the_dense_kl(tail):
    teacher, student = logits(1), logits(2)
    p, q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    t, s = on_support(teacher, student, V, tail)
    if tail == "extra_class":
        # No mass is left outside the whole vocabulary.
        assert (t[..., -1] == float("-inf")).all() and (s[..., -1] == float("-inf")).all()
    close(forward_kl(t, s), dense_kl(p, q))
    close(reverse_kl(t, s), dense_kl(q, p))


def test_renormalize_by_hand():
    # Teacher top-2 = tokens 0, 1 (logits 2, 1): renormalised p = (e, 1) / (e + 1).
    # Student on tokens 0, 1 (logits 0, 1): q = (1, e) / (e + 1).
    # KL(p || q) = p0 ln(p0/q0) + p1 ln(p1/q1) = p0 * 1 + p1 * -1 = (e - 1) / (e + 1) = tanh(1/2);
    # by symmetry KL(q || p) is the same.
    teacher = torch.tensor([2.0, 1.0, 0.0, -1.0])
    student = torch.tensor([0.0, 1.0, 2.0, 3.0])
    t, s = on_support(teacher, student, 2, "renormalize")
    close(t.exp(), [math.e / (math.e + 1), 1 / (math.e + 1)])
    close(forward_kl(t, s), math.tanh(0.5))
    close(reverse_kl(t, s), math.tanh(0.5))


def test_renormalize_matches_scalar_reference_on_random_logits():
    teacher, student = logits(3, shape=(4, V)), logits(4, shape=(4, V))
    t, s = on_support(teacher, student, 3, "renormalize")
    fwd, rev = [], []
    for trow, srow in zip(teacher.tolist(), student.tolist()):
        top = sorted(range(V), key=lambda i: -trow[i])[:3]
        zt = sum(math.exp(trow[i]) for i in top)
        zs = sum(math.exp(srow[i]) for i in top)
        p = [math.exp(trow[i]) / zt for i in top]
        q = [math.exp(srow[i]) / zs for i in top]
        fwd.append(sum(a * math.log(a / b) for a, b in zip(p, q)))
        rev.append(sum(b * math.log(b / a) for a, b in zip(p, q)))
    close(forward_kl(t, s), fwd)
    close(reverse_kl(t, s), rev)


def test_extra_class_by_hand():
    # Teacher logits (2, 1, 0, -1), Z = e^2 + e + 1 + e^-1; top-2 keeps tokens 0, 1 and the tail class
    # holds (1 + e^-1) / Z.
    teacher = torch.tensor([2.0, 1.0, 0.0, -1.0])
    z = math.exp(2) + math.e + 1 + math.exp(-1)
    _, t = teacher_topk(teacher, 2, "extra_class")
    close(t.exp(), [math.exp(2) / z, math.e / z, (1 + math.exp(-1)) / z])


@pytest.mark.parametrize("k", [1, 3, V - 1])
def test_extra_class_keeps_all_the_mass(k):
    teacher, student = logits(5), logits(6)
    t, s = on_support(teacher, student, k, "extra_class")
    assert t.shape[-1] == k + 1
    close(t.exp().sum(-1), torch.ones(2, 3))
    close(s.exp().sum(-1), torch.ones(2, 3))


# ------------------------------------------------------------------------------- generalized JSD


def test_jsd_limits_are_the_two_kls():
    # The approach to the limit is first order in beta with a slope that grows with the largest
    # probability ratio (here the error is at most 2e-3 relative); at logit scale 2 a ratio of e^10 makes
    # the true value at 1 - 1e-4 itself 1% off, in float64 too.
    t, s = torch.log_softmax(logits(7, scale=1.0), -1), torch.log_softmax(logits(8, scale=1.0), -1)
    fwd, rev = forward_kl(t, s), reverse_kl(t, s)
    close(generalized_jsd(t, s, 1e-4), fwd, rtol=1e-2, atol=1e-4)
    close(generalized_jsd(t, s, 1 - 1e-4), rev, rtol=1e-2, atol=1e-4)
    assert torch.equal(generalized_jsd(t, s, 0.0), fwd)
    assert torch.equal(generalized_jsd(t, s, 1.0), rev)


@pytest.mark.parametrize("beta", [0.2, 0.5, 0.9])
def test_jsd_swapping_roles_mirrors_beta(beta):
    t, s = torch.log_softmax(logits(9), -1), torch.log_softmax(logits(10), -1)
    close(generalized_jsd(t, s, beta), generalized_jsd(s, t, 1 - beta))


def test_jsd_matches_scalar_reference():
    # The rescaled JSD_beta = (beta KL(p||m) + (1-beta) KL(q||m)) / (beta (1-beta)), m the mixture.
    beta = 0.3
    p = [0.7, 0.2, 0.1]
    q = [0.1, 0.3, 0.6]
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
    kl_pm = sum(a * math.log(a / c) for a, c in zip(p, m))
    kl_qm = sum(b * math.log(b / c) for b, c in zip(q, m))
    expected = (beta * kl_pm + (1 - beta) * kl_qm) / (beta * (1 - beta))
    value = generalized_jsd(torch.tensor(p).log(), torch.tensor(q).log(), beta)
    close(value, expected)
    # At beta = 0.5 it is 4x the usual JSD.
    m = [(a + b) / 2 for a, b in zip(p, q)]
    usual = 0.5 * sum(a * math.log(a / c) for a, c in zip(p, m)) + 0.5 * sum(
        b * math.log(b / c) for b, c in zip(q, m)
    )
    close(generalized_jsd(torch.tensor(p).log(), torch.tensor(q).log(), 0.5), 4 * usual)


def test_bad_arguments_are_refused():
    x = logits(11)
    with pytest.raises(ValueError, match="beta in"):
        generalized_jsd(x, x, 1.5)
    with pytest.raises(ValueError, match="renormalize"):
        teacher_topk(x, 2, "drop")
    with pytest.raises(ValueError, match="k="):
        teacher_topk(x, V + 1, "renormalize")
    with pytest.raises(ValueError, match="gamma"):
        distillation_advantages(x[0], x[0], torch.ones(3, V), coef=1.0, gamma=1.5)


# ------------------------------------------------------------------------ finiteness and gradients


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize(("tail", "k"), [("renormalize", 3), ("extra_class", 3), ("extra_class", V)])
def test_gradients_are_finite(name, tail, k):
    # extra_class with k == V: the tail class has probability 0 for teacher and student (log -inf).
    teacher = logits(12)
    student = logits(13).requires_grad_()
    t, s = on_support(teacher, student, k, tail)
    value = DISTILL_OBJECTIVES.get(name)(t, s, beta=0.5)
    assert torch.isfinite(value).all()
    value.sum().backward()
    assert torch.isfinite(student.grad).all()
    assert student.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["forward_kl", "jsd"])
@pytest.mark.parametrize("tail", TAILS)
def test_teacher_with_a_zero_probability_token(name, tail):
    # The teacher rules token 0 out (logit -inf); the student does not. Forward KL and JSD stay finite.
    teacher = logits(14)
    teacher[..., 0] = float("-inf")
    student = logits(15).requires_grad_()
    t, s = on_support(teacher, student, V, tail)
    value = DISTILL_OBJECTIVES.get(name)(t, s, beta=0.5)
    assert torch.isfinite(value).all()
    value.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_reverse_kl_is_infinite_where_only_the_teacher_rules_a_token_out():
    # KL(q || p) with p = 0 < q is +inf: the true value, not a NaN.
    t = torch.tensor([0.0, float("-inf")])
    s = torch.log(torch.tensor([0.5, 0.5]))
    assert reverse_kl(t, s).item() == float("inf")


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("k", [3, V])
def test_no_nan_with_very_peaked_logits(tail, k):
    teacher = logits(16, scale=1e4)
    student = logits(17, scale=1e4).requires_grad_()
    t, s = on_support(teacher, student, k, tail)
    assert not torch.isnan(t).any() and not torch.isnan(s).any()
    for name in OBJECTIVES:
        for beta in (0.0, 0.5, 1e-4, 1.0):
            student.grad = None
            value = DISTILL_OBJECTIVES.get(name)(t, s, beta=beta)
            assert torch.isfinite(value).all(), (name, beta)
            value.sum().backward(retain_graph=True)
            assert torch.isfinite(student.grad).all(), (name, beta)
    lp_s = torch.log_softmax(student.detach(), -1)[..., 0]
    lp_t = torch.log_softmax(teacher, -1)[..., 0]
    adv = distillation_advantages(lp_s, lp_t, torch.ones(2, 3), coef=1.0, gamma=0.5)
    assert torch.isfinite(adv).all()


def test_bfloat16_logits_are_computed_in_float32():
    teacher, student = logits(18).bfloat16(), logits(19).bfloat16()
    t, s = on_support(teacher, student, 3, "extra_class")
    assert t.dtype == s.dtype == torch.float32
    assert forward_kl(t.bfloat16(), s.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("tail", ["renormalize", "extra_class"])
def test_chunks_of_positions_give_the_whole_tensors_values_and_gradients(monkeypatch, tail):
    """The teacher's top-k and the student's support are computed a few positions at a time (here 2 of the
    6, so 3 chunks) with no float32 copy of the whole logits: values and gradients are the one-pass ones."""
    import roll.algorithms.functional as F
    from roll.algorithms.distillation import support_logprobs

    teacher, student = logits(20).bfloat16(), logits(21)
    whole_indices = torch.topk(teacher.float(), 3, dim=-1).indices
    whole_teacher = support_logprobs(teacher.float(), whole_indices, tail)
    plain = student.clone().requires_grad_()
    whole_student = support_logprobs(plain, whole_indices, tail)
    monkeypatch.setattr(F, "_LOGIT_CHUNK_ELEMENTS", 2 * V)
    indices, teacher_logprobs = teacher_topk(teacher, 3, tail)
    assert torch.equal(indices, whole_indices)
    close(teacher_logprobs, whole_teacher)
    chunked = student.clone().requires_grad_()
    student_logprobs = student_on_support(chunked, indices, tail)
    close(student_logprobs, whole_student)
    weights = torch.randn(student_logprobs.shape)
    (student_logprobs * weights).sum().backward()
    (whole_student * weights).sum().backward()
    close(chunked.grad, plain.grad)


# ------------------------------------------------------------------------------------- advantages

# Row 0: a hole at t = 2 (an environment token) and padding at t = 4 (log-probabilities -inf there).
# Row 1: trained tokens only at t = 2..4.
STUDENT = [[-1.0, -2.0, -5.0, -0.5, float("-inf")], [0.0, 0.0, -1.0, -1.0, -1.0]]
TEACHER = [[-1.5, -1.0, -0.1, -1.0, float("-inf")], [0.0, 0.0, -2.0, -1.0, 0.0]]
MASK = [[1, 1, 0, 1, 0], [0, 0, 1, 1, 1]]
# r = -coef (student - teacher), coef = 2:
#   row 0: -2 * 0.5 = -1, -2 * -1 = 2, (hole), -2 * 0.5 = -1, (pad)  ->  [-1, 2, 0, -1, 0]
#   row 1:                              -2 * 1 = -2, 0, -2 * -1 = 2  ->  [0, 0, -2, 0, 2]
# gamma 0.5, row 0: A3 = -1; A1 = 2 + 0.5 * -1 = 1.5 (the hole costs no discount step);
#   A0 = -1 + 0.5 * 1.5 = -0.25.  Row 1: A4 = 2; A3 = 0 + 0.5 * 2 = 1; A2 = -2 + 0.5 * 1 = -1.5.
# gamma 1, row 0: A3 = -1, A1 = 1, A0 = 0.  Row 1: A4 = 2, A3 = 2, A2 = 0.
EXPECTED = {
    0.0: [[-1.0, 2.0, 0.0, -1.0, 0.0], [0.0, 0.0, -2.0, 0.0, 2.0]],
    0.5: [[-0.25, 1.5, 0.0, -1.0, 0.0], [0.0, 0.0, -1.5, 1.0, 2.0]],
    1.0: [[0.0, 1.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 2.0, 2.0]],
}


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_distillation_advantages_by_hand(gamma, mask_dtype):
    student = torch.tensor(STUDENT, requires_grad=True)
    adv = distillation_advantages(
        student, torch.tensor(TEACHER), torch.tensor(MASK, dtype=mask_dtype), coef=2.0, gamma=gamma
    )
    assert adv.dtype == torch.float32 and not adv.requires_grad
    close(adv, EXPECTED[gamma], atol=1e-6)
