"""Hand-computed checks and invariants for roll.algorithms.

Expected numbers are worked out in the comments next to them, not by calling the code under test.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from roll.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from roll.algorithms import functional as F
from roll.algorithms.losses import entropy_loss, kl_penalty_loss


def close(actual: torch.Tensor | float, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0.0,
    )


# --------------------------------------------------------------------------------------- functional


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])


@pytest.mark.parametrize("mask", [MASK, MASK.bool()], ids=["float", "bool"])
def test_masked_sum_and_mean(mask):
    close(F.masked_sum(VALUES, mask), 14.0)  # 1 + 2 + 5 + 6
    close(F.masked_sum(VALUES, mask, dim=-1), [3.0, 11.0])
    close(F.masked_mean(VALUES, mask), 3.5)  # 14 / 4
    close(F.masked_mean(VALUES, mask, dim=-1), [1.5, 5.5])


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(F.masked_mean(VALUES, mask, dim=-1), [1.5, 0.0])
    close(F.masked_mean(VALUES, torch.zeros_like(VALUES)), 0.0)


def test_masked_whiten():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    # mean 2.5; unbiased var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3; std = 1.290994
    std = math.sqrt(5 / 3)
    expected = [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std]  # -1.161895, -0.387298, ...
    close(F.masked_whiten(values, mask)[0, :4], expected)
    close(F.masked_whiten(values, mask, shift_mean=False)[0, :4], [e + 2.5 for e in expected])


def test_logprobs_and_entropy_from_logits_by_hand():
    # Row 0: logits log([1, 2, 1]) + 5 -> probs [0.25, 0.5, 0.25] (softmax ignores the shift).
    # Row 1: uniform over 3 tokens.
    logits = torch.tensor([[[5.0, 5.0 + math.log(2.0), 5.0], [0.0, 0.0, 0.0]]], requires_grad=True)
    labels = torch.tensor([[1, 2]])
    logprobs = F.logprobs_from_logits(logits, labels)
    assert logprobs.shape == (1, 2) and logprobs.dtype == torch.float32
    close(logprobs, [[math.log(0.5), math.log(1 / 3)]])  # -0.693147, -1.098612

    # d log p[label] / d logits = onehot(label) - probs
    logprobs[0, 0].backward()
    close(logits.grad[0, 0], [-0.25, 0.5, -0.25])
    close(logits.grad[0, 1], [0.0, 0.0, 0.0])

    # H([.25, .5, .25]) = 0.5 ln 4 + 0.5 ln 2 = 1.039721; H(uniform 3) = ln 3 = 1.098612
    entropy = F.entropy_from_logits(logits.detach())
    close(entropy, [[0.5 * math.log(4) + 0.5 * math.log(2), math.log(3)]])


def test_logit_helpers_chunking_and_half_precision(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    labels = torch.randint(0, 7, (3, 5))
    reference_logprobs = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    reference_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)

    # Chunks of 4 rows over 15 flattened rows: the last chunk is partial.
    monkeypatch.setattr(F, "_LOGIT_CHUNK_ELEMENTS", 4 * 7)
    close(F.logprobs_from_logits(logits, labels), reference_logprobs)
    close(F.entropy_from_logits(logits), reference_entropy)

    out = F.logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32  # upcast before log-softmax
    close(out, reference_logprobs, atol=0.05)

    # The temperature is applied chunk by chunk, as if the logits had been divided first.
    close(F.logprobs_from_logits(logits, labels, 0.7), F.logprobs_from_logits(logits / 0.7, labels))
    close(F.entropy_from_logits(logits, 0.7), F.entropy_from_logits(logits / 0.7))

    # Gradients through the chunks (each recomputed in the backward pass) are the unchunked ones.
    weights = torch.randn(3, 5)
    chunked, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = (F.logprobs_from_logits(chunked, labels, 0.7) + F.entropy_from_logits(chunked, 0.7)) * weights
    loss.sum().backward()
    scaled = plain / 0.7
    by_hand = torch.log_softmax(scaled, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    by_hand = by_hand - (torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
    (by_hand * weights).sum().backward()
    close(chunked.grad, plain.grad)


# --------------------------------------------------------------------------------------- advantages


def _outcome_rewards(scores: list[float], lengths: list[int], width: int = 3):
    """Rewards on the last response token of each row, plus the matching response mask."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for row, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        mask[row, :length] = 1.0
        rewards[row, length - 1] = score
    return rewards, mask


def test_grpo_by_hand_with_non_contiguous_groups():
    # Groups (ids not contiguous, not from 0): 7 -> rows 0, 2, 4; 3 -> rows 1, 3; 5 -> row 5 alone.
    rewards, mask = _outcome_rewards([1.0, 0.0, 0.0, 4.0, 2.0, 3.0], [3, 2, 1, 3, 2, 3])
    group_index = torch.tensor([7, 3, 7, 3, 7, 5])
    grpo = ADVANTAGE_ESTIMATORS.get("grpo")
    advantages, returns = grpo(rewards, mask, group_index)

    # group 7: scores 1, 0, 2 -> mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 -> 0, -1, 1
    # group 3: scores 0, 4 -> mean 2, unbiased std sqrt((4 + 4) / 1) = 2.828427 -> -0.707107, 0.707107
    # group 5: a single sample -> 0
    per_row = torch.tensor([0.0, -1 / math.sqrt(2), -1.0, 1 / math.sqrt(2), 1.0, 0.0])
    close(advantages, per_row[:, None] * mask)
    assert torch.equal(returns, advantages)
    assert advantages.shape == (6, 3) and advantages.dtype == torch.float32

    centred, _ = grpo(rewards, mask, group_index, norm_adv_by_std=False)
    per_row = torch.tensor([0.0, -2.0, -1.0, 2.0, 1.0, 0.0])  # score - group mean
    close(centred, per_row[:, None] * mask)


def test_grpo_ignores_rewards_on_padding_and_zeros_padding():
    rewards = torch.tensor([[0.0, 1.0, 9.0], [0.0, 0.0, 0.0]])  # 9.0 sits on a padding token
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages, _ = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, mask, torch.tensor([0, 0]))
    # scores 1, 0 -> mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.707107 -> +-0.707107
    close(advantages, [[1 / math.sqrt(2), 1 / math.sqrt(2), 0.0], [-1 / math.sqrt(2)] * 3])


def test_grpo_equal_scores_give_zero_advantage():
    rewards, mask = _outcome_rewards([1.0, 1.0, 1.0], [1, 2, 3])
    advantages, _ = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, mask, torch.tensor([0, 0, 0]))
    close(advantages, torch.zeros(3, 3))


def test_grpo_invariants_zero_mean_unit_std_per_group():
    torch.manual_seed(0)
    num_groups, group_size, width = 5, 4, 6
    group_index = torch.arange(num_groups).repeat(group_size)[torch.randperm(num_groups * group_size)]
    lengths = torch.randint(1, width + 1, (num_groups * group_size,))
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.randn(num_groups * group_size, width) * mask
    advantages, _ = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, mask, group_index)

    assert torch.all(advantages[mask == 0] == 0)
    per_sample = advantages[:, 0]  # every row has at least one response token
    for group in range(num_groups):
        members = per_sample[group_index == group]
        close(members.mean(), 0.0)
        close(members.std(), 1.0, atol=1e-4)  # unbiased, like the estimator


def test_reinforce_baseline_by_hand():
    rewards, mask = _outcome_rewards([1.0, 0.0, 2.0, 1.0], [1, 2, 3, 3])
    advantages, returns = ADVANTAGE_ESTIMATORS.get("reinforce_baseline")(
        rewards, mask, torch.tensor([0, 0, 1, 1])
    )
    per_row = torch.tensor([0.0, -1.0, 1.0, 0.0])  # batch mean 1; groups are ignored
    close(advantages, per_row[:, None] * mask)
    assert torch.equal(returns, advantages)


# --------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    close(KL_ESTIMATORS.get("k1")(logprobs, ref), [[1.0, -1.0]])
    close(KL_ESTIMATORS.get("k2")(logprobs, ref), [[0.5, 0.5]])
    # ref - lp = -1, +1: e^-1 + 1 - 1 = 0.367879; e^1 - 1 - 1 = 0.718282
    close(KL_ESTIMATORS.get("k3")(logprobs, ref), [[math.exp(-1), math.e - 2]])
    close(KL_ESTIMATORS.get("abs")(logprobs, ref), [[1.0, 1.0]])


def test_k3_is_non_negative_zero_when_equal_and_clamped():
    torch.manual_seed(0)
    logprobs, ref = torch.randn(4, 8), torch.randn(4, 8)
    k3 = KL_ESTIMATORS.get("k3")
    assert torch.all(k3(logprobs, ref) >= 0)
    close(k3(logprobs, logprobs), torch.zeros(4, 8))
    # exp(20) - 20 - 1 would be ~4.9e8: clamped to 10.
    close(k3(torch.tensor([-20.0]), torch.tensor([0.0])), [10.0])


# --------------------------------------------------------------------------------------- aggregation


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 is a padding row


def test_aggregations_by_hand():
    close(LOSS_AGGREGATIONS.get("token-mean")(LOSS, LOSS_MASK), 2.5)  # (1 + 2 + 3 + 4) / 4
    # per-sequence means 2 and 4; the all-padding row is not a sequence -> 3
    close(LOSS_AGGREGATIONS.get("seq-mean-token-mean")(LOSS, LOSS_MASK), 3.0)
    close(LOSS_AGGREGATIONS.get("seq-mean-token-sum")(LOSS, LOSS_MASK), 5.0)  # (6 + 4) / 2

    close(LOSS_AGGREGATIONS.get("token-mean")(LOSS, LOSS_MASK, 10.0), 1.0)  # 10 / 10
    close(LOSS_AGGREGATIONS.get("seq-mean-token-mean")(LOSS, LOSS_MASK, 10.0), 0.6)  # (2 + 4) / 10
    close(LOSS_AGGREGATIONS.get("seq-mean-token-sum")(LOSS, LOSS_MASK, 10.0), 1.0)  # (6 + 4) / 10


def test_aggregation_rejects_non_positive_denominator():
    with pytest.raises(ValueError, match="denominator"):
        LOSS_AGGREGATIONS.get("token-mean")(LOSS, LOSS_MASK, 0.0)


@pytest.mark.parametrize(
    ("mode", "count"),
    [
        ("token-mean", lambda mask: mask.sum()),
        ("seq-mean-token-mean", lambda mask: (mask.sum(-1) > 0).sum()),
        ("seq-mean-token-sum", lambda mask: (mask.sum(-1) > 0).sum()),
    ],
)
def test_micro_batches_with_denominator_match_one_batch(mode, count):
    torch.manual_seed(0)
    weights = torch.randn(6, 5, requires_grad=True)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[0] = 1.0  # micro-batches with different token counts: the case a local mean gets wrong
    aggregate = LOSS_AGGREGATIONS.get(mode)

    full = aggregate(weights**2, mask)
    (full_grad,) = torch.autograd.grad(full, weights)

    denominator = float(count(mask))
    parts = [aggregate(weights[rows] ** 2, mask[rows], denominator) for rows in (slice(0, 2), slice(2, 6))]
    accumulated = sum(parts)
    (accumulated_grad,) = torch.autograd.grad(accumulated, weights)
    close(accumulated, full)
    close(accumulated_grad, full_grad)


# --------------------------------------------------------------------------------------- policy loss


def _ppo_case():
    """Five response tokens and one padding token, with ratios chosen to hit every PPO branch."""
    ratios = torch.tensor([[1.5, 0.5, 0.5], [1.5, 1.0, 3.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    return logprobs, old, advantages, mask


def test_ppo_clip_by_hand():
    logprobs, old, advantages, mask = _ppo_case()
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(logprobs, old, advantages, mask)
    # token (A, r): unclipped -A r, clipped -A clip(r, 0.8, 1.2), loss = max
    # (1, 1.5):  -1.5 vs -1.2 -> -1.2 (clipped)
    # (1, 0.5):  -0.5 vs -0.8 -> -0.5
    # (-1, 0.5):  0.5 vs  0.8 ->  0.8 (clipped)
    # (-1, 1.5):  1.5 vs  1.2 ->  1.5
    # (2, 1.0):  -2.0 vs -2.0 -> -2.0
    # token-mean: (-1.2 - 0.5 + 0.8 + 1.5 - 2.0) / 5 = -0.28
    close(loss, -0.28)
    assert metrics["clip_frac"] == pytest.approx(0.4)  # 2 of 5
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # (1.5 + 0.5 + 0.5 + 1.5 + 1) / 5
    assert metrics["ratio_max"] == pytest.approx(1.5, abs=1e-6)  # the padding token's 3.0 is ignored
    # 0.5 * ln(r)^2: 2 * 0.082201 (r = 1.5) + 2 * 0.240227 (r = 0.5) + 0 = 0.644856; / 5
    assert metrics["approx_kl"] == pytest.approx(0.128971, abs=1e-5)
    assert all(type(value) is float for value in metrics.values())

    loss.backward()
    # d loss / d logprob = -A r / 5 on unclipped tokens; 0 on clipped tokens and padding
    close(logprobs.grad, [[0.0, -0.1, 0.0], [0.3, -0.4, 0.0]])


def test_ppo_clip_zero_gradient_outside_trust_region_in_clipped_direction():
    old = torch.zeros(4)
    # A > 0 with r > 1 + high, and A < 0 with r < 1 - low: clipped, no gradient.
    # A > 0 with r < 1 - low, and A < 0 with r > 1 + high: the pessimistic side keeps the gradient.
    logprobs = torch.log(torch.tensor([1.3, 0.7, 0.7, 1.3])).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logprobs[None], old[None], advantages[None], torch.ones(1, 4))
    loss.backward()
    assert logprobs.grad[0] == 0 and logprobs.grad[1] == 0
    assert logprobs.grad[2] != 0 and logprobs.grad[3] != 0


def test_ppo_clip_asymmetric_bounds():
    old = torch.zeros(1, 1)
    advantages = torch.ones(1, 1)
    mask = torch.ones(1, 1)
    ppo = POLICY_LOSSES.get("ppo_clip")
    for clip_high, expect_grad in ((0.2, False), (0.28, True)):  # ratio 1.25 is inside 1.28, not 1.2
        logprobs = torch.full((1, 1), math.log(1.25), requires_grad=True)
        loss, _ = ppo(logprobs, old, advantages, mask, clip_ratio_high=clip_high)
        loss.backward()
        assert (logprobs.grad.abs().item() > 0) == expect_grad


def test_ppo_clip_clamps_log_ratio_and_uses_agg_mode():
    logprobs = torch.tensor([[100.0, 0.0]])
    old = torch.zeros(1, 2)
    advantages = torch.tensor([[-1.0, 1.0]])
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(
        logprobs, old, advantages, torch.ones(1, 2), loss_agg_mode="seq-mean-token-sum"
    )
    # ratio exp(20) = 4.85e8 (not inf); A = -1 takes the unclipped branch: 4.85e8; second token -1
    assert math.isfinite(loss.item()) and math.isfinite(metrics["ratio_max"])
    close(loss, math.exp(20.0) - 1.0, atol=1e2)
    with pytest.raises(KeyError, match="Did you mean 'token-mean'"):
        POLICY_LOSSES.get("ppo_clip")(logprobs, old, advantages, torch.ones(1, 2), loss_agg_mode="token_mean")


def test_kl_penalty_and_entropy_losses():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0]])
    ref = torch.tensor([[-2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # k3 on the two masked tokens: (0.367879 + 0.718282) / 2 = 0.543081
    close(kl_penalty_loss(logprobs, ref, mask), (math.exp(-1) + math.e - 2) / 2)
    close(kl_penalty_loss(logprobs, ref, mask, estimator="k1"), 0.0)  # (1 - 1) / 2
    close(kl_penalty_loss(logprobs, ref, mask, estimator="k2", denominator=4.0), 0.25)  # (0.5 + 0.5) / 4

    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    entropy_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    close(entropy_loss(entropy, entropy_mask), 2.0)  # 6 / 3
    close(entropy_loss(entropy, entropy_mask, loss_agg_mode="seq-mean-token-mean"), 2.25)  # (1.5 + 3) / 2


# --------------------------------------------------------------------------------------- registries


@pytest.mark.parametrize(
    ("registry", "typo", "suggestion"),
    [
        (ADVANTAGE_ESTIMATORS, "grp", "grpo"),
        (POLICY_LOSSES, "ppo-clip", "ppo_clip"),
        (LOSS_AGGREGATIONS, "seq-mean-token-means", "seq-mean-token-mean"),
        (KL_ESTIMATORS, "k_3", "k3"),
    ],
)
def test_unknown_registry_name_suggests_the_closest(registry, typo, suggestion):
    with pytest.raises(KeyError, match=f"Did you mean '{suggestion}'"):
        registry.get(typo)


def test_registries_list_builtin_entries():
    assert {"grpo", "reinforce_baseline"} <= set(ADVANTAGE_ESTIMATORS.names())
    assert {"k1", "k2", "k3", "abs"} <= set(KL_ESTIMATORS.names())
    assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"} <= set(LOSS_AGGREGATIONS.names())
    assert "ppo_clip" in POLICY_LOSSES


def test_algorithms_and_rewards_import_no_ray():
    code = "import sys, roll.algorithms, roll.rewards; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
