"""From scores to advantages as the config asks (roll/pipelines/credit.py): shaping order, outcome
rewards on the last token, process rewards on every token, KL in the reward, estimator parameters,
whitening and clipping."""

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
    token_level_rewards,
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


# --------------------------------------------------------------------------- process rewards


def test_token_level_rewards_without_process_rewards_equals_outcome_rewards():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    shaped = torch.tensor([0.5, -0.25, 1.0, 0.0])
    expected = outcome_token_rewards(shaped, MASK)
    assert torch.equal(token_level_rewards(scores, shaped, MASK), expected)
    assert torch.equal(token_level_rewards(scores, shaped, MASK, [None] * 4), expected)


def test_process_rewards_sit_on_response_tokens_with_the_shaping_delta_on_the_last():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    shaped = torch.tensor([0.5, -0.25, 1.0, 0.0])
    process = [[0.25, 0.25, 0.5], None, [0.0, 0.5, 0.0, 0.5], [0.5, 0.0]]
    rewards = token_level_rewards(scores, shaped, MASK, process)
    expected = torch.tensor(
        [
            [0.25, 0.25, 0.5 - 0.5, 0.0],  # delta -0.5 on the last of 3 tokens
            [-0.25, 0.0, 0.0, 0.0],  # no process rewards: the shaped score on its one token
            [0.0, 0.5, 0.0, 0.5],  # no shaping: delta 0
            [0.5, 0.0 - 0.5, 0.0, 0.0],
        ]
    )
    assert torch.allclose(rewards, expected)
    # Process rewards summing to the score give the shaped score as the sequence return.
    assert torch.allclose((rewards * MASK).sum(dim=1), shaped)


def test_process_rewards_of_the_wrong_length_are_rejected():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="row 0: 2 process rewards for 3 response tokens"):
        token_level_rewards(scores, scores, MASK, [[0.5, 0.5], None, None, None])
    with pytest.raises(ValueError, match="row 3: 3 process rewards for 2 response tokens"):
        token_level_rewards(scores, scores, MASK, [None, None, None, [0.1, 0.2, 0.3]])
    with pytest.raises(ValueError, match="2 rows for a batch of 4"):
        token_level_rewards(scores, scores, MASK, [None, None])


def test_grpo_sees_the_sum_of_process_rewards_as_the_score():
    # Two groups whose outcome scores are equal, so outcome-only GRPO has no signal at all.
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    group = torch.tensor([0, 0, 1, 1])
    algo = AlgorithmConfig(norm_adv_by_std=False)
    outcome_adv, _ = compute_advantages(algo, token_level_rewards(scores, scores, MASK), MASK, group)
    assert torch.equal(outcome_adv, torch.zeros_like(MASK))
    # Row 0's process rewards sum to 1.5 and row 3's to -0.5; rows 1 and 2 keep their outcome scores.
    process = [[0.5, 0.5, 0.5], None, None, [0.0, -0.5]]
    rewards = token_level_rewards(scores, scores, MASK, process)
    adv, _ = compute_advantages(algo, rewards, MASK, group)
    # Group means 1.25 and -0.25: each sample's advantage is its summed reward minus its group's mean,
    # on every response token.
    expected = torch.tensor([[0.25], [-0.25], [0.25], [-0.25]]) * MASK
    assert torch.allclose(adv, expected)
