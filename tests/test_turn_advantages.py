"""GiGPO and step-wise REINFORCE against numbers worked out by hand in the comments (not by calling the
code under test), with singleton anchor groups, gamma, both normalisations and padding rows."""

from __future__ import annotations

import math

import pytest
import torch
from test_algorithms import close

from roll.algorithms import ADVANTAGE_ESTIMATORS
from roll.algorithms.turn_advantages import discounted_turn_returns

# Two groups. Group 0: episode 0 (2 turns, rewards 0 then 1) and episode 1 (3 turns, all 0). Group 1:
# episode 2 alone (1 turn, reward 1). Rows are shuffled on purpose: order must not matter.
#   row:          0  1  2  3  4  5
EPISODE = [1, 0, 2, 1, 0, 1]
TURN = [2, 1, 0, 0, 0, 1]
REWARD = [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
GROUP = [0, 0, 1, 0, 0, 0]
# Anchors: both episodes start from the same state (rows 3, 4); episode 0's turn 1 and episode 1's turn
# 2 act from the same state (rows 1, 0); episode 1's turn 1 (row 5) and episode 2 (row 2) are alone.
ANCHOR = [10, 10, 30, 11, 11, 12]


def _turns(**overrides):
    fields = {
        "episode_index": torch.tensor(EPISODE),
        "turn_index": torch.tensor(TURN),
        "turn_rewards": torch.tensor(REWARD),
        "anchor_index": torch.tensor(ANCHOR),
    }
    fields.update(overrides)
    return fields


def _run(name: str, mask: torch.Tensor | None = None, group=GROUP, **params):
    fields = _turns()
    mask = torch.ones(len(EPISODE), 3) if mask is None else mask
    fn = ADVANTAGE_ESTIMATORS.get(name)
    keep = {k: v for k, v in fields.items() if k in fn.__code__.co_varnames}
    return fn(torch.zeros_like(mask), mask, torch.tensor(group), **keep, **params)


def test_discounted_turn_returns_by_hand():
    # gamma 0.5: episode 0: turn 1 -> 1, turn 0 -> 0 + 0.5 * 1 = 0.5; episode 1: all 0; episode 2: 1.
    returns = discounted_turn_returns(torch.tensor(REWARD), torch.tensor(EPISODE), torch.tensor(TURN), 0.5)
    close(returns, [0.0, 1.0, 1.0, 0.0, 0.5, 0.0])
    # gamma 1 sums what is left of the episode; a padding row (-1) gets 0.
    returns = discounted_turn_returns(
        torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 0, -1]), torch.tensor([0, 1, 0]), 1.0
    )
    close(returns, [3.0, 2.0, 0.0])


def test_gigpo_mean_norm_by_hand():
    # Episode returns: e0 = 1, e1 = 0 (group 0, mean 0.5) -> A_E = +0.5, -0.5; e2 alone in group 1 -> 0.
    # Step returns (gamma 0.5): e0 t0 0.5, e0 t1 1; e1 0, 0, 0; e2 1.
    # Anchor 11 (rows 4, 3): returns 0.5, 0 -> mean 0.25 -> A_S +0.25, -0.25.
    # Anchor 10 (rows 1, 0): returns 1, 0 -> +0.5, -0.5. Anchors 12, 30: singletons -> 0.
    # omega 1: row 0 (e1 t2) -0.5 - 0.5 = -1; row 1 (e0 t1) 0.5 + 0.5 = 1; row 2 (e2) 0;
    # row 3 (e1 t0) -0.5 - 0.25 = -0.75; row 4 (e0 t0) 0.5 + 0.25 = 0.75; row 5 (e1 t1) -0.5 + 0 = -0.5.
    advantages, returns = _run("gigpo", gamma=0.5, step_advantage_weight=1.0)
    close(advantages[:, 0], [-1.0, 1.0, 0.0, -0.75, 0.75, -0.5])
    close(returns[:, 0], [0.0, 1.0, 1.0, 0.0, 0.5, 0.0])
    assert torch.equal(advantages[:, 0], advantages[:, 2])  # one advantage per turn, on every token

    # omega 0.5 halves the step part only: row 4: 0.5 + 0.125 = 0.625; row 1: 0.5 + 0.25 = 0.75.
    advantages, _ = _run("gigpo", gamma=0.5, step_advantage_weight=0.5)
    close(advantages[:, 0], [-0.75, 0.75, 0.0, -0.625, 0.625, -0.5])
    # omega 0: every turn of an episode gets its episode's group advantage (GRPO per episode).
    advantages, _ = _run("gigpo", gamma=0.5, step_advantage_weight=0.0)
    close(advantages[:, 0], [-0.5, 0.5, 0.0, -0.5, 0.5, -0.5])


def test_gigpo_counts_each_episode_once_and_gamma_matters():
    # gamma 1: e0's turns both return 1. Anchor 11: 1 vs 0 -> +-0.5 (with 0.5 it was +-0.25).
    advantages, _ = _run("gigpo", gamma=1.0)
    close(advantages[:, 0], [-1.0, 1.0, 0.0, -1.0, 1.0, -0.5])
    # Episode 1 has 3 turns and episode 0 has 2, but the group mean is over episodes: (1 + 0) / 2, not
    # (1 + 1 + 0 + 0 + 0) / 5 (which would give e0 +0.6): row 5, alone at its anchor, shows A_E = -0.5.
    assert advantages[5, 0].item() == pytest.approx(-0.5)


def test_gigpo_mean_std_norm_by_hand():
    # Group 0's episode returns 1, 0: unbiased std sqrt(0.5) -> A_E = +-0.5 / 0.7071 = +-0.7071.
    # Anchor 11 (0.5, 0): std 0.35355 -> +-0.25 / 0.35355 = +-0.7071; anchor 10 (1, 0): +-0.7071.
    r = 0.5 / math.sqrt(0.5)
    advantages, _ = _run("gigpo", gamma=0.5, step_norm="mean_std_norm")
    close(advantages[:, 0], [-2 * r, 2 * r, 0.0, -2 * r, 2 * r, -r], atol=1e-4)
    with pytest.raises(ValueError, match="step_norm"):
        _run("gigpo", step_norm="zscore")


def test_padding_rows_change_nothing_and_get_zero():
    base, _ = _run("gigpo", gamma=0.5)
    # A duplicate of row 1 marked as padding: every statistic ignores it, and its advantage is 0.
    fields = _turns()
    padded = {k: torch.cat([v, v[1:2]]) for k, v in fields.items()}
    padded["episode_index"][-1] = -1
    mask = torch.ones(7, 3)
    mask[-1] = 0
    advantages, returns = ADVANTAGE_ESTIMATORS.get("gigpo")(
        torch.zeros(7, 3), mask, torch.tensor([*GROUP, 0]), **padded, gamma=0.5
    )
    close(advantages[:6], base)
    assert torch.all(advantages[6] == 0) and torch.all(returns[6] == 0)


def test_masked_turns_stay_in_the_baseline_but_get_no_advantage():
    # Row 3 (e1 t0) has no trained token (stop policy "mask"): it still counts at anchor 11, so row 4
    # keeps +0.75, while row 3's own tokens carry nothing.
    mask = torch.ones(6, 3)
    mask[3] = 0
    advantages, _ = _run("gigpo", mask=mask, gamma=0.5)
    close(advantages[:, 0], [-1.0, 1.0, 0.0, 0.0, 0.75, -0.5])


def test_step_reinforce_by_hand():
    # Group 0's turns' step returns (gamma 0.5): rows 0, 1, 3, 4, 5 -> 0, 1, 0, 0.5, 0; mean 0.3.
    # mean_norm: -0.3, 0.7, -0.3, 0.2, -0.3; group 1 (row 2) alone -> 0.
    advantages, returns = _run("step_reinforce", gamma=0.5)
    close(advantages[:, 0], [-0.3, 0.7, 0.0, -0.3, 0.2, -0.3])
    close(returns[:, 0], [0.0, 1.0, 1.0, 0.0, 0.5, 0.0])
    # mean_std_norm: unbiased std of (0, 1, 0, 0.5, 0) = sqrt((0.09*3 + 0.49 + 0.04) / 4) = sqrt(0.2).
    std = math.sqrt(0.2)
    advantages, _ = _run("step_reinforce", gamma=0.5, step_norm="mean_std_norm")
    close(advantages[:, 0], [-0.3 / std, 0.7 / std, 0.0, -0.3 / std, 0.2 / std, -0.3 / std], atol=1e-4)


def test_turn_estimators_are_marked_per_turn():
    names = ADVANTAGE_ESTIMATORS.names()
    per_turn = {name for name in names if ADVANTAGE_ESTIMATORS.traits(name).get("per_turn")}
    assert per_turn == {"gigpo", "step_reinforce"}
