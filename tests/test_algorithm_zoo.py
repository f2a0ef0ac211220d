"""Hand-computed checks and invariants for the estimator / loss / shaping zoo in roll.algorithms.

Expected numbers are worked out in the comments next to them, not by calling the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_algorithms import _outcome_rewards, close

from roll.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, aggregation_count
from roll.algorithms.advantages import clip_advantages, whiten_advantages
from roll.algorithms.kl import adaptive_kl_coef
from roll.algorithms.losses import truncated_is_weights, value_loss
from roll.algorithms.reward_shaping import clip_rewards, length_penalty, normalize_rewards, overlong_penalty
from roll.utils.registry import accepted_kwargs

# Every knob the pipeline may offer an estimator / a policy loss; each function takes what it declares.
ESTIMATOR_PARAMS = {"values": None, "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True}
LOSS_PARAMS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
METRIC_KEYS = {"clip_frac", "approx_kl", "ratio_mean", "ratio_max"}


def _estimate(name: str, rewards, mask, group_index, **params):
    return ADVANTAGE_ESTIMATORS.get(name)(rewards, mask, group_index, **params)


# Groups (ids not contiguous): 7 -> rows 0, 2, 4 (scores 1, 0, 2); 3 -> rows 1, 3 (0, 4); 5 -> row 5.
GROUPED = _outcome_rewards([1.0, 0.0, 0.0, 4.0, 2.0, 3.0], [3, 2, 1, 3, 2, 3])
GROUP_INDEX = torch.tensor([7, 3, 7, 3, 7, 5])


def _random_groups(seed: int = 0, width: int = 6):
    """Groups of uneven sizes (4, 3, 2, 1) in shuffled order, uneven lengths, per-token rewards."""
    torch.manual_seed(seed)
    group_index = torch.tensor([0] * 4 + [1] * 3 + [2] * 2 + [3])[torch.randperm(10)]
    lengths = torch.randint(1, width + 1, (10,))
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.randn(10, width) * mask
    return rewards, mask, group_index


# --------------------------------------------------------------------------------------- advantages


def test_dr_grpo_by_hand_and_ignores_std_knob():
    rewards, mask = GROUPED
    advantages, returns = _estimate("dr_grpo", rewards, mask, GROUP_INDEX)
    per_row = torch.tensor([0.0, -2.0, -1.0, 2.0, 1.0, 0.0])  # score - group mean (1, 2, 3)
    close(advantages, per_row[:, None] * mask)
    assert torch.equal(returns, advantages)
    # It declares no knob, so a config's norm_adv_by_std=True cannot turn it back into GRPO.
    assert accepted_kwargs(ADVANTAGE_ESTIMATORS.get("dr_grpo"), ESTIMATOR_PARAMS) == {}


def test_rloo_by_hand():
    rewards, mask = GROUPED
    advantages, returns = _estimate("rloo", rewards, mask, GROUP_INDEX)
    # group 7: 1 - (0 + 2) / 2 = 0; 0 - (1 + 2) / 2 = -1.5; 2 - (1 + 0) / 2 = 1.5
    # group 3: 0 - 4 = -4; 4 - 0 = 4; singleton group 5: 0
    per_row = torch.tensor([0.0, -4.0, -1.5, 4.0, 1.5, 0.0])
    close(advantages, per_row[:, None] * mask)
    assert torch.equal(returns, advantages)


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.5, 0.0, 9.0]])  # 9.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = _estimate("reinforce_plus_plus", rewards, mask, torch.tensor([0, 1]), gamma=0.5)
    # row 0: G2 = 1.0, G1 = -0.2 + 0.5 * 1.0 = 0.3, G0 = 0.1 + 0.5 * 0.3 = 0.25
    # row 1: G1 = 0.0, G0 = 0.5 + 0.5 * 0.0 = 0.5
    close(returns, [[0.25, 0.3, 1.0], [0.5, 0.0, 0.0]])
    # masked G: 0.25, 0.3, 1.0, 0.5, 0.0 -> mean 0.41; deviations -0.16, -0.11, 0.59, 0.09, -0.41
    # squares sum 0.0256 + 0.0121 + 0.3481 + 0.0081 + 0.1681 = 0.562 -> unbiased var 0.1405
    std = math.sqrt(0.1405)  # 0.374833
    close(advantages, [[-0.16 / std, -0.11 / std, 0.59 / std], [0.09 / std, -0.41 / std, 0.0]])

    # gamma = 1 (the default): plain sums of future rewards
    _, returns = _estimate("reinforce_plus_plus", rewards, mask, torch.tensor([0, 1]))
    close(returns, [[0.9, 0.8, 1.0], [0.5, 0.0, 0.0]])


def test_reinforce_plus_plus_skips_environment_tokens():
    rewards = torch.tensor([[1.0, 5.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # the middle token came from the environment
    _, returns = _estimate("reinforce_plus_plus", rewards, mask, torch.tensor([0]), gamma=0.5)
    # G2 = 2; G0 = 1 + 0.5 * 2 = 2 (the environment token adds nothing and is no discount step)
    close(returns, [[2.0, 0.0, 2.0]])


def test_reinforce_plus_plus_baseline_by_hand():
    # groups 0 -> scores 1, 0 (length 1 each); 1 -> scores 3, 1 (length 2 each)
    rewards, mask = _outcome_rewards([1.0, 0.0, 3.0, 1.0], [1, 1, 2, 2], width=2)
    advantages, returns = _estimate("reinforce_plus_plus_baseline", rewards, mask, torch.tensor([0, 0, 1, 1]))
    # centred: 0.5, -0.5 | 1, -1 -> tokens 0.5, -0.5, 1, 1, -1, -1: mean 0, unbiased var 4.5 / 5 = 0.9
    close(returns, [[0.5, 0.0], [-0.5, 0.0], [1.0, 1.0], [-1.0, -1.0]])
    std = math.sqrt(0.9)  # 0.948683
    close(advantages, [[0.5 / std, 0.0], [-0.5 / std, 0.0], [1 / std, 1 / std], [-1 / std, -1 / std]])


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 7.0, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.8], [0.2, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages, returns = _estimate(
        "gae", rewards, mask, torch.tensor([0, 1]), values=values, gamma=0.9, lam=0.5
    )
    # row 0: deltas t2 = 1 + 0 - 0.8 = 0.2; t1 = 0.9 * 0.8 - 0.6 = 0.12; t0 = 0.9 * 0.6 - 0.5 = 0.04
    #        A2 = 0.2; A1 = 0.12 + 0.45 * 0.2 = 0.21; A0 = 0.04 + 0.45 * 0.21 = 0.1345
    # row 1: one token, terminal after it: A0 = 0.5 - 0.2 = 0.3; padding stays 0
    close(advantages, [[0.1345, 0.21, 0.2], [0.3, 0.0, 0.0]])
    close(returns, [[0.6345, 0.81, 1.0], [0.5, 0.0, 0.0]])  # A + V


def test_gae_invariants_lam_one_and_lam_zero():
    rewards, mask, group_index = _random_groups(seed=1)
    values = torch.randn_like(rewards)
    advantages, returns = _estimate("gae", rewards, mask, group_index, values=values, gamma=1.0, lam=1.0)
    future = rewards.flip(-1).cumsum(-1).flip(-1)  # rewards are zero on padding
    close(advantages, (future - values) * mask)
    close(returns, future * mask)

    gamma = 0.8
    advantages, _ = _estimate("gae", rewards, mask, group_index, values=values, gamma=gamma, lam=0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(10, 1)], dim=-1)  # 0 after the end
    close(advantages, (rewards + gamma * next_values - values) * mask)
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)


def test_gae_needs_values():
    rewards, mask = GROUPED
    with pytest.raises(ValueError, match="values"):
        _estimate("gae", rewards, mask, GROUP_INDEX)
    with pytest.raises(ValueError, match="values"):
        _estimate("gae", rewards, mask, GROUP_INDEX, values=torch.zeros(6, 2))


def test_group_estimators_zero_mean_per_group_and_rloo_scaling():
    rewards, mask, group_index = _random_groups()
    per_sample = {}
    for name in ("grpo", "dr_grpo", "rloo"):
        per_sample[name] = _estimate(name, rewards, mask, group_index)[0][:, 0]  # every row has a token
    # reinforce_plus_plus_baseline before whitening is its `returns`
    per_sample["reinforce_plus_plus_baseline"] = _estimate(
        "reinforce_plus_plus_baseline", rewards, mask, group_index
    )[1][:, 0]
    for values in per_sample.values():
        for group in range(4):
            close(values[group_index == group].mean(), 0.0)
        assert torch.all(values[group_index == 3] == 0)  # the singleton group

    sizes = torch.tensor([4.0, 3.0, 2.0, 1.0])[group_index]
    factor = torch.where(sizes > 1, sizes / (sizes - 1), torch.zeros_like(sizes))
    close(per_sample["rloo"], factor * per_sample["dr_grpo"])


def test_sequence_estimators_count_an_episode_once_however_many_rows_it_has():
    """An agent run trained on every branch (agent.train_branches: all) is several rows with its score:
    with ``episode_index`` the group's statistics are over runs, and padding rows (-1) count for nothing.
    One group: run 0 has 3 rows scoring 1, run 1 one row scoring 0, then a padding copy of row 0."""
    rewards, mask = _outcome_rewards([1.0, 1.0, 1.0, 0.0, 1.0], [2, 1, 3, 2, 2])
    group_index, episode_index = torch.zeros(5, dtype=torch.long), torch.tensor([0, 0, 0, 1, -1])
    mask[4] = 0  # a padding row trains nothing
    # Over runs: mean 0.5, unbiased std sqrt(2 * 0.25 / 1) = 0.7071 -> GRPO +-0.7071.
    run = torch.tensor([1.0, 1.0, 1.0, -1.0, 0.0])
    cases = {
        "grpo": run * 0.5 / math.sqrt(0.5),
        "dr_grpo": run * 0.5,
        "rloo": run * 0.5 * 2,  # n / (n - 1) with n = 2 runs
        "reinforce_baseline": run * 0.5,
    }
    for name, expected in cases.items():
        advantages, _ = _estimate(name, rewards, mask, group_index, episode_index=episode_index)
        close(advantages, expected[:, None] * mask, atol=1e-5)
    # Without it each row counts, the padding row as a score of 0 (it trains no token): mean 3 / 5.
    advantages, _ = _estimate("dr_grpo", rewards, mask, group_index)
    close(advantages[3, 0], torch.tensor(-0.6))


def test_estimators_declare_only_their_knobs():
    declared = {
        name: set(accepted_kwargs(ADVANTAGE_ESTIMATORS.get(name), ESTIMATOR_PARAMS))
        for name in ("grpo", "rloo", "reinforce_plus_plus", "gae")
    }
    assert declared == {
        "grpo": {"norm_adv_by_std"},
        "rloo": set(),
        "reinforce_plus_plus": {"gamma"},
        "gae": {"values", "gamma", "lam"},
    }


def test_whiten_and_clip_advantages():
    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # mean 2.5; unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    std = math.sqrt(5 / 3)
    close(whiten_advantages(advantages, mask), [[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]])

    close(clip_advantages(torch.tensor([-3.0, 0.5, 2.0, 0.0]), 1.0), [-1.0, 0.5, 1.0, 0.0])
    with pytest.raises(ValueError, match="> 0"):
        clip_advantages(advantages, 0.0)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_smoke(name):
    traits = ADVANTAGE_ESTIMATORS.traits(name)
    assert set(traits) >= {"needs_groups", "needs_values"}
    assert isinstance(traits["needs_groups"], bool) and isinstance(traits["needs_values"], bool)
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if traits["needs_values"]:
        assert "values" in accepted_kwargs(fn, ESTIMATOR_PARAMS)

    rewards, mask, _ = _random_groups(seed=2)
    mask[4] = 0.0  # an all-padding row
    group_index = torch.arange(5).repeat(2)  # 5 groups of 2
    offered = {**ESTIMATOR_PARAMS, "values": torch.randn_like(rewards), "gamma": 0.9}
    if traits.get("per_turn"):  # one row per turn: rows 2k and 2k+1 are two turns of one episode
        offered |= {
            "episode_index": torch.arange(10) // 2,
            "turn_index": torch.arange(10) % 2,
            "turn_rewards": torch.randn(10),
            "anchor_index": torch.arange(10) % 3,
        }
    params = accepted_kwargs(fn, offered)
    advantages, returns = fn(rewards, mask, group_index, **params)
    for out in (advantages, returns):
        assert out.shape == rewards.shape and out.dtype == torch.float32 and not out.requires_grad
        assert torch.isfinite(out).all()
        assert torch.all(out[mask == 0] == 0)


# --------------------------------------------------------------------------------------- aggregation


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 is a padding row


def test_seq_mean_token_sum_norm_and_counts_by_hand():
    aggregate = LOSS_AGGREGATIONS.get("seq-mean-token-sum-norm")
    close(aggregate(LOSS, LOSS_MASK), 10 / 6)  # (1 + 2 + 3 + 4) / (2 sequences * width 3)
    close(aggregate(LOSS, LOSS_MASK, 5.0), 2.0)  # 10 / 5

    expected = {"token-mean": 4.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum": 2.0}
    expected["seq-mean-token-sum-norm"] = 6.0
    assert set(LOSS_AGGREGATIONS.names()) == set(expected)
    for mode, count in expected.items():
        close(aggregation_count(mode, LOSS_MASK), count)
        close(aggregation_count(mode, LOSS_MASK.bool()), count)
        # an all-padding batch counts 0, and its loss is 0 rather than NaN
        close(aggregation_count(mode, torch.zeros(2, 3)), 0.0)
        close(LOSS_AGGREGATIONS.get(mode)(LOSS[:2], torch.zeros(2, 3)), 0.0)


@pytest.mark.parametrize("ways", [1, 2, 4])
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_split_batches_with_aggregation_count_match_one_batch(mode, ways):
    torch.manual_seed(0)
    weights = torch.randn(8, 5, requires_grad=True)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])  # uneven, and row 3 is all padding
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    aggregate = LOSS_AGGREGATIONS.get(mode)

    full = aggregate(weights**2, mask)
    (full_grad,) = torch.autograd.grad(full, weights)

    denominator = aggregation_count(mode, mask)
    rows = torch.arange(8).chunk(ways)
    accumulated = sum(aggregate(weights[r] ** 2, mask[r], denominator) for r in rows)
    (accumulated_grad,) = torch.autograd.grad(accumulated, weights)
    close(accumulated, full)
    close(accumulated_grad, full_grad)


# --------------------------------------------------------------------------------------- policy losses


def _logprobs(ratios: list, old: float = -1.0):
    """``old_logprobs`` filled with ``old`` and ``logprobs`` giving the requested ratios."""
    ratios = torch.tensor(ratios)
    old_logprobs = torch.full_like(ratios, old)
    return (old_logprobs + ratios.log()).requires_grad_(True), old_logprobs


def test_dual_clip_by_hand():
    logprobs, old = _logprobs([[1.5, 0.5, 4.0, 2.0]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, -2.0]])
    loss, metrics = POLICY_LOSSES.get("dual_clip")(logprobs, old, advantages, torch.ones(1, 4))
    # (A, r): PPO loss, cap -3A for A < 0
    # (1, 1.5):  max(-1.5, -1.2) = -1.2 (clipped)
    # (-1, 0.5): max(0.5, 0.8) = 0.8 (clipped); cap 3 is larger -> 0.8
    # (-1, 4):   max(4, 1.2) = 4; cap 3 -> 3 (dual clip)
    # (-2, 2):   max(4, 2.4) = 4; cap 6 -> 4
    # token-mean (-1.2 + 0.8 + 3 + 4) / 4 = 1.65
    close(loss, 1.65)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["dual_clip_frac"] == pytest.approx(0.25)
    assert metrics["ratio_mean"] == pytest.approx(2.0, abs=1e-6)  # (1.5 + 0.5 + 4 + 2) / 4
    assert metrics["ratio_max"] == pytest.approx(4.0, abs=1e-5)
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0, 0.0, 1.0]])  # only the last is unclipped: -A r / 4 = 4 / 4

    with pytest.raises(ValueError, match="clip_ratio_c"):
        POLICY_LOSSES.get("dual_clip")(logprobs, old, advantages, torch.ones(1, 4), clip_ratio_c=1.0)


def test_gspo_by_hand():
    old = torch.full((2, 2), -1.0)
    log_ratios = torch.tensor([[0.1, 0.3], [-0.2, 0.4]])  # row 1's second token is padding
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    gspo = POLICY_LOSSES.get("gspo")

    logprobs = (old + log_ratios).requires_grad_(True)
    loss, metrics = gspo(logprobs, old, advantages, mask)
    # s0 = exp((0.1 + 0.3) / 2) = e^0.2 = 1.221403 > 1.2 with A > 0: clipped, loss -1.2 per token
    # s1 = exp(-0.2) = 0.818731, inside [0.8, 1.2]: loss -A s1 = 0.818731
    # token-mean over 3 tokens: (-1.2 - 1.2 + 0.818731) / 3 = -0.527090
    close(loss, -0.527090)
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    assert metrics["ratio_mean"] == pytest.approx(1.087179, abs=1e-5)  # (2 * 1.221403 + 0.818731) / 3
    assert metrics["ratio_max"] == pytest.approx(1.221403, abs=1e-5)
    assert metrics["approx_kl"] == pytest.approx(0.023333, abs=1e-5)  # 0.5 * (0.01 + 0.09 + 0.04) / 3
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0], [0.272910, 0.0]])  # -A s1 / 3

    # Wider range: row 0 is kept; both its tokens get the same -A s0 / 3 = -0.407134, although
    # their own token ratios differ: the ratio is the sequence's.
    logprobs = (old + log_ratios).requires_grad_(True)
    loss, _ = gspo(logprobs, old, advantages, mask, clip_ratio_low=0.5, clip_ratio_high=0.5)
    loss.backward()
    close(logprobs.grad[0], [-0.407134, -0.407134])


def test_cispo_by_hand():
    logprobs, old = _logprobs([[1.5, 0.5, 1.0]])  # logprobs -0.594535, -1.693147, -1
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    loss, metrics = POLICY_LOSSES.get("cispo")(logprobs, old, advantages, torch.ones(1, 3))
    # weights clip(r, 0.8, 1.2) = 1.2, 0.8, 1.0; loss_t = -w A logprob
    # 1.2 * 0.594535 = 0.713442; -0.8 * 1.693147 = -1.354518; 2 * 1 = 2 -> mean 0.452975
    close(loss, 0.452975)
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    close(logprobs.grad, [[-0.4, 0.8 / 3, -2 / 3]])  # -w A / 3: clipped tokens keep a gradient


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo"])
def test_zero_gradient_outside_trust_region_in_favoured_direction(name):
    # One token per sequence, so gspo's sequence ratio is the token ratio.
    logprobs, old = _logprobs([[1.3], [0.7], [0.7], [1.3], [1.1]])
    advantages = torch.tensor([[1.0], [-1.0], [1.0], [-1.0], [1.0]])
    loss, _ = POLICY_LOSSES.get(name)(logprobs, old, advantages, torch.ones(5, 1))
    loss.backward()
    grad = logprobs.grad[:, 0]
    # A > 0, r > 1.2 and A < 0, r < 0.8: clipped, no gradient
    assert grad[0] == 0 and grad[1] == 0
    # the pessimistic side (A > 0, r < 0.8; A < 0, r > 1.2) and the inside keep their gradient
    assert grad[2] != 0 and grad[3] != 0 and grad[4] != 0


def test_dual_clip_zero_gradient_beyond_c():
    logprobs, old = _logprobs([[3.5, 2.5]])
    advantages = torch.tensor([[-1.0, -1.0]])
    loss, metrics = POLICY_LOSSES.get("dual_clip")(logprobs, old, advantages, torch.ones(1, 2))
    loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0  # ratio 3.5 > c = 3 > 2.5
    assert metrics["dual_clip_frac"] == pytest.approx(0.5)


def test_cispo_keeps_gradient_on_clipped_tokens():
    logprobs, old = _logprobs([[1.3, 0.7]])
    advantages = torch.tensor([[1.0, -1.0]])  # both outside the range in the favoured direction
    loss, metrics = POLICY_LOSSES.get("cispo")(logprobs, old, advantages, torch.ones(1, 2))
    loss.backward()
    assert metrics["clip_frac"] == 1.0
    assert torch.all(logprobs.grad != 0)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_every_policy_loss_smoke(name, mode):
    torch.manual_seed(3)
    old = -torch.rand(4, 5) * 3
    logprobs = (old + 0.3 * torch.randn(4, 5)).requires_grad_(True)
    advantages = torch.randn(4, 5)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 2, 0, 3])[:, None]).float()
    fn = POLICY_LOSSES.get(name)
    loss, metrics = fn(
        logprobs, old, advantages, mask, loss_agg_mode=mode, **accepted_kwargs(fn, LOSS_PARAMS)
    )
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(metrics) >= METRIC_KEYS
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[mask == 0] == 0)  # no gradient on padding


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 0.5, 9.0]], requires_grad=True)  # the last token is padding
    old_values = torch.tensor([[0.0, 1.0, 0.5, 0.0]])
    returns = torch.tensor([[1.5, 0.0, 1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range_value=0.2)
    # t0: 0.5 * 0.5^2 = 0.125; clipped V = 0.2 -> 0.5 * 1.3^2 = 0.845 -> 0.845 (clipped, no grad)
    # t1: 0.5 * 2^2 = 2.0; clipped V = 1.2 -> 0.72 -> 2.0 (grad V - R = 2)
    # t2: V = old V: 0.5 * 1^2 = 0.5 (grad -1)
    # token-mean (0.845 + 2 + 0.5) / 3 = 1.115
    close(loss, 1.115)
    assert metrics["vf_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["values_mean"] == pytest.approx(3.5 / 3)
    # Var(R) over 1.5, 0, 1.5 = 1.5 / 2 = 0.75; R - V = 0.5, -2, 1 -> mean -1/6, squares of deviations
    # 4/9 + 121/36 + 49/36 = 186/36 -> var 93/36 = 2.583333; EV = 1 - 2.583333 / 0.75 = -2.444444
    assert metrics["explained_variance"] == pytest.approx(-2.444444, abs=1e-5)
    loss.backward()
    close(values.grad, [[0.0, 2 / 3, -1 / 3, 0.0]])

    unclipped, metrics = value_loss(values, old_values, returns, mask, clip_range_value=0.0)
    close(unclipped, 0.875)  # (0.125 + 2 + 0.5) / 3
    assert metrics["vf_clip_frac"] == 0.0

    _, metrics = value_loss(values, old_values, torch.ones(1, 4), mask)
    assert metrics["explained_variance"] == 0.0  # constant returns


def test_truncated_is_weights_by_hand():
    old = torch.full((1, 4), -1.0, requires_grad=True)
    rollout = torch.tensor([[-1.5, -0.5, -1.0 - math.log(3.0), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, metrics = truncated_is_weights(old, rollout, mask, cap=2.0)
    # exp(0.5) = 1.648721, exp(-0.5) = 0.606531, exp(ln 3) = 3 -> capped at 2; padding 0
    close(weights, [[1.648721, 0.606531, 2.0, 0.0]])
    assert not weights.requires_grad
    assert metrics["tis_weight_mean"] == pytest.approx(1.418417, abs=1e-5)  # 4.255252 / 3
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, rollout, mask, cap=0.5)


def test_engine_mismatch_is_over_the_trained_tokens_only():
    from roll.workers.actor_losses import engine_mismatch

    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = torch.tensor(
        [[-1.25, -1.5, -0.5, -9.0]]
    )  # the last token is not trained: its gap is not counted
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert engine_mismatch(trainer, engine, mask) == pytest.approx(
        {"logprob_diff_mean": 0.25, "logprob_diff_max": 0.5}  # (0.25 + 0.5 + 0) / 3
    )
    assert engine_mismatch(trainer, engine, torch.zeros(1, 4))["logprob_diff_max"] == 0.0
    # Two rows, the second sampled a version before the trained weights: only the first is lagless.
    two = engine_mismatch(
        trainer.repeat(2, 1),
        engine.repeat(2, 1) - torch.tensor([[0.0], [1.0]]),
        mask.repeat(2, 1),
        staleness=torch.tensor([0, 1]),
    )
    assert two["logprob_diff_current_max"] == pytest.approx(0.5) and two["logprob_diff_max"] == pytest.approx(
        1.25
    )
    assert "logprob_diff_current_max" not in engine_mismatch(trainer, engine, mask, torch.tensor([2]))


# --------------------------------------------------------------------------------------- KL controller


def test_adaptive_kl_coef():
    # error clipped to +-0.2; step = error * 256 / 10000
    assert adaptive_kl_coef(0.1, 0.15, 0.1, 10000, 256) == pytest.approx(0.100512)  # error 0.5 -> 0.2
    assert adaptive_kl_coef(0.1, 0.11, 0.1, 10000, 256) == pytest.approx(0.100256)  # error 0.1
    assert adaptive_kl_coef(0.1, 0.09, 0.1, 10000, 256) == pytest.approx(0.099744)  # error -0.1
    assert adaptive_kl_coef(0.1, 0.0, 0.1, 10000, 256) == pytest.approx(0.099488)  # error -1 -> -0.2
    assert adaptive_kl_coef(0.1, 0.1, 0.1, 10000, 256) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="target_kl"):
        adaptive_kl_coef(0.1, 0.1, 0.0, 10000, 256)
    with pytest.raises(ValueError, match="horizon"):
        adaptive_kl_coef(0.1, 0.1, 0.1, 0, 256)


# --------------------------------------------------------------------------------------- reward shaping


def test_overlong_penalty():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    # ramp starts at 20 - 5 = 15: (15 - L) / 5 inside (15, 20], -1 beyond
    close(overlong_penalty(lengths, max_length=20, buffer_length=5), [0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    close(overlong_penalty(lengths, 20, 5, penalty_factor=0.5), [0.0, 0.0, -0.1, -0.3, -0.5, -0.5])
    for buffer_length in (0, 21):
        with pytest.raises(ValueError, match="buffer_length"):
            overlong_penalty(lengths, 20, buffer_length)


def test_length_penalty():
    close(length_penalty(torch.tensor([0, 10, 40]), max_length=40, coef=0.5), [0.0, -0.125, -0.5])
    with pytest.raises(ValueError, match="max_length"):
        length_penalty(torch.tensor([1]), max_length=0, coef=0.5)


def test_normalize_rewards():
    # mean 3, deviations -2, -1, 0, 3; unbiased var 14 / 3 -> std 2.160247
    close(normalize_rewards(torch.tensor([1.0, 2.0, 3.0, 6.0])), [-0.925820, -0.462910, 0.0, 1.388730])
    close(normalize_rewards(torch.tensor([5.0])), [0.0])
    close(normalize_rewards(torch.tensor([2.0, 2.0, 2.0])), [0.0, 0.0, 0.0])


def test_clip_rewards():
    close(clip_rewards(torch.tensor([-3.0, 0.5, 2.0]), 1.0), [-1.0, 0.5, 1.0])
    for bound in (0.0, -1.0):
        with pytest.raises(ValueError, match="bound"):
            clip_rewards(torch.tensor([1.0]), bound)
