"""From scores to advantages as the config asks (roll/pipelines/credit.py): shaping order, outcome
rewards on the last token, KL in the reward, estimator parameters, whitening and clipping."""

from __future__ import annotations

import pytest
import torch

from roll.config.rlvr import AlgorithmConfig, RewardShapingConfig
from roll.pipelines.credit import (
    compute_advantages,
    kl_per_token,
    outcome_token_rewards,
    shape_scores,
    shaping_enabled,
)

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)


def test_outcome_reward_sits_on_the_last_response_token():
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), MASK)
    expected = torch.tensor([[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 3], [0, 4, 0, 0]], dtype=torch.float32)
    assert torch.equal(rewards, expected)


def test_shaping_is_off_by_default():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert torch.equal(shape_scores(scores, MASK.sum(1), RewardShapingConfig(), max_new_tokens=4), scores)


def test_overlong_penalty_then_clip():
    # max_new_tokens 4, buffer 2: lengths 3 -> -0.5, 1 -> 0, 4 -> -1, 2 -> 0.
    shaping = RewardShapingConfig(overlong_buffer=2, clip=0.25)
    shaped = shape_scores(torch.tensor([1.0, 1.0, 1.0, 0.0]), MASK.sum(1), shaping, max_new_tokens=4)
    assert torch.allclose(shaped, torch.tensor([0.25, 0.25, 0.0, 0.0]))


def test_normalise_comes_before_clip_and_after_penalties():
    shaping = RewardShapingConfig(length_penalty_coef=1.0, normalize=True, clip=1.0)
    shaped = shape_scores(torch.tensor([1.0, 1.0, 1.0, 1.0]), MASK.sum(1), shaping, max_new_tokens=4)
    # Penalties -0.75, -0.25, -1, -0.5 make the scores differ; normalised they have zero mean.
    assert shaped.abs().max() <= 1.0 and abs(shaped.mean().item()) < 1e-6
    assert shaped.argmax() == 1 and shaped.argmin() == 2


def test_kl_per_token_is_masked():
    logprobs = torch.full_like(MASK, -1.0)
    ref = torch.full_like(MASK, -2.0)
    assert torch.equal(kl_per_token(logprobs, ref, MASK, "k1"), MASK)


def test_estimator_receives_only_its_parameters_then_whitening_and_clipping():
    group = torch.tensor([0, 0, 1, 1])
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0, 1.0, 1.0]), MASK)
    # grpo takes norm_adv_by_std but not gamma/lam/values: passing them all must not fail.
    adv, returns = compute_advantages(AlgorithmConfig(norm_adv_by_std=False), rewards, MASK, group)
    assert torch.allclose(adv[0], torch.tensor([0.5, 0.5, 0.5, 0.0]))
    assert torch.allclose(adv[2], torch.zeros(4))
    whitened, _ = compute_advantages(AlgorithmConfig(whiten_advantages=True), rewards, MASK, group)
    assert abs((whitened * MASK).sum().item() / MASK.sum().item()) < 1e-5
    clipped, _ = compute_advantages(
        AlgorithmConfig(whiten_advantages=True, advantage_clip=0.5), rewards, MASK, group
    )
    assert clipped.abs().max().item() == pytest.approx(0.5)


def test_gae_gets_values_gamma_and_lambda():
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0, 1.0, 1.0]), MASK)
    values = torch.full_like(MASK, 0.25) * MASK
    algo = AlgorithmConfig(advantage_estimator="gae", gamma=1.0, lam=1.0)
    adv, returns = compute_advantages(algo, rewards, MASK, torch.arange(4), values)
    # lambda = gamma = 1: advantage = final score - value on every token.
    expected = (torch.tensor([[1.0], [0.0], [1.0], [1.0]]) - 0.25) * MASK
    assert torch.allclose(adv, expected)
    assert torch.allclose(returns, torch.tensor([[1.0], [0.0], [1.0], [1.0]]) * MASK)
    half, _ = compute_advantages(
        AlgorithmConfig(advantage_estimator="gae", gamma=0.5, lam=1.0), rewards, MASK, torch.arange(4), values
    )
    # Row 0: the score is 2 tokens after the first one, discounted by 0.5 ** 2.
    assert half[0, 0].item() == pytest.approx(0.25 - 0.25)


def test_shaping_enabled_by_any_option():
    assert not shaping_enabled(RewardShapingConfig())
    for option in ({"overlong_buffer": 2}, {"length_penalty_coef": 0.1}, {"normalize": True}, {"clip": 1.0}):
        assert shaping_enabled(RewardShapingConfig(**option)), option
