"""Advantage estimators for step-wise agentic samples: one training sample per turn of an episode.

They share the signature of ``roll.algorithms.advantages`` and read four more per-row inputs, which the
episode scheduler's step-wise batches carry (``roll.rollout.episode_batch``):

    episode_index: ``[B]`` long; the rows (turns) of one episode share a value. -1 marks a padding row
        (a duplicate that fills the batch to a divisor): it is left out of every statistic and gets 0.
    turn_index: ``[B]`` long; the turn's position in its episode, from 0.
    turn_rewards: ``[B]`` float; the environment's reward for that turn (after the stop policy).
    anchor_index: ``[B]`` long; turns of one group (``group_index``: the episodes of one seed) that acted
        from the same state (the same observation) share a value.

``group_index`` is per row too: every turn of an episode carries its episode's group. ``gamma`` is the
discount per *turn* here (a step return ``R_t = r_t + gamma * R_{t+1}`` over the episode's turns).
``step_norm`` picks the normalisation: ``mean_norm`` subtracts the group mean, ``mean_std_norm`` also
divides by the group's std. The advantage is per turn and broadcast to the turn's trained tokens.

Registered with the trait ``per_turn=True``: the config validator allows them, and only them, with
``env.sample_layout: step_wise``.
"""

from __future__ import annotations

import torch

from roll.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_mean_std

STEP_NORMS = ("mean_norm", "mean_std_norm")


def discounted_turn_returns(
    turn_rewards: torch.Tensor, episode_index: torch.Tensor, turn_index: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``[B]`` step returns ``R_t = r_t + gamma * R_{t+1}`` within each episode, in turn order (rows may
    come in any order); 0 on padding rows (``episode_index`` -1).

    Args:
        turn_rewards: ``[B]`` float.
        episode_index: ``[B]`` long.
        turn_index: ``[B]`` long.
        gamma: discount per turn, in (0, 1].
    """
    rewards = turn_rewards.to(torch.float32)
    returns = torch.zeros_like(rewards)
    # Sorted by episode, then by turn from last to first: one pass carries each episode's running return.
    order = sorted(
        (i for i in range(len(rewards)) if episode_index[i] >= 0),
        key=lambda i: (int(episode_index[i]), -int(turn_index[i])),
    )
    running, episode = 0.0, None
    for i in order:
        if int(episode_index[i]) != episode:
            running, episode = 0.0, int(episode_index[i])
        running = float(rewards[i]) + gamma * running
        returns[i] = running
    return returns


def _normalised(values: torch.Tensor, groups: torch.Tensor, step_norm: str, eps: float) -> torch.Tensor:
    """``values`` centred on their group's mean (and divided by its std + eps for ``mean_std_norm``); a
    group of one value gets 0."""
    if step_norm not in STEP_NORMS:
        raise ValueError(f"step_norm must be one of {', '.join(STEP_NORMS)}, got {step_norm!r}")
    if values.numel() == 0:
        return values
    mean, std = group_mean_std(values, groups)
    centred = values - mean
    return centred / (std + eps) if step_norm == "mean_std_norm" else centred


def _episode_returns(
    turn_rewards: torch.Tensor, episode_index: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One entry per episode: its return (the sum of its turns' rewards) and group, and for every valid
    row the position of its episode in those entries."""
    episodes, row_episode = torch.unique(episode_index, return_inverse=True)
    returns = torch.zeros(len(episodes)).index_add_(0, row_episode, turn_rewards.to(torch.float32))
    groups = torch.zeros(len(episodes), dtype=torch.long).scatter_(0, row_episode, group_index)
    return returns, groups, row_episode


@ADVANTAGE_ESTIMATORS.register("gigpo", needs_groups=True, needs_values=False, per_turn=True)
def gigpo_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    episode_index: torch.Tensor,
    turn_index: torch.Tensor,
    turn_rewards: torch.Tensor,
    anchor_index: torch.Tensor,
    gamma: float = 1.0,
    step_advantage_weight: float = 1.0,
    step_norm: str = "mean_norm",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"): an
    episode-level group advantage plus a step-level one, per turn::

        A(turn t of episode i) = A_E(i) + step_advantage_weight * A_S(t)

        A_E(i) = R_i - mean of R over the episodes of i's group          (mean_norm)
                 (... ) / (std + eps)                                     (mean_std_norm)
        A_S(t) = R_t - mean of R_t over the turns of t's anchor group      (and / (std + eps))

    ``R_i`` is the episode's return (the undiscounted sum of its turns' rewards); ``R_t`` the turn's
    discounted step return (``discounted_turn_returns``). The anchor group of a turn is every turn of its
    group's episodes that acted from the same state: it compares the actions taken there by how they
    turned out. A state visited once (a singleton anchor group) gets a step advantage of 0, and so does a
    singleton episode group at the episode level. Each episode counts once in its group's statistics,
    whatever its number of turns.

    Args:
        token_level_rewards: ``[B, T]`` (unused: the turns' rewards come in ``turn_rewards``).
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` long, the episode group of each row.
        episode_index, turn_index, turn_rewards, anchor_index: ``[B]``, see the module docstring.
        gamma: discount per turn for ``R_t``.
        step_advantage_weight: omega, the weight of the step-level advantage (0: episode-level GRPO on
            every turn).
        step_norm: ``mean_norm`` or ``mean_std_norm``, for both levels.
        eps: keeps the std division finite.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32: the turn's advantage and its step return
        ``R_t`` on its trained tokens, 0 elsewhere and on padding rows.
    """
    with torch.no_grad():
        valid = episode_index >= 0
        step_returns = discounted_turn_returns(turn_rewards, episode_index, turn_index, gamma)
        advantage = torch.zeros(len(episode_index))
        if valid.any():
            returns, groups, row_episode = _episode_returns(
                turn_rewards[valid], episode_index[valid], group_index[valid]
            )
            episode_advantage = _normalised(returns, groups, step_norm, eps)[row_episode]
            step_advantage = _normalised(step_returns[valid], anchor_index[valid], step_norm, eps)
            advantage[valid] = episode_advantage + step_advantage_weight * step_advantage
    return _on_tokens(advantage, step_returns, loss_mask)


@ADVANTAGE_ESTIMATORS.register("step_reinforce", needs_groups=False, needs_values=False, per_turn=True)
def step_reinforce_advantages(
    token_level_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    episode_index: torch.Tensor,
    turn_index: torch.Tensor,
    turn_rewards: torch.Tensor,
    gamma: float = 1.0,
    step_norm: str = "mean_norm",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-wise REINFORCE (ROLL's ``step_reinforce``): each turn's discounted step return ``R_t``,
    normalised over the turns of its episode group::

        A(t) = R_t - mean of R over the group's turns           (mean_norm)
               (R_t - mean) / (std + eps)                      (mean_std_norm)

    Unlike GiGPO it does not look at states: every turn is compared with all the turns of its group,
    so it rewards turns close to a good outcome (with ``gamma`` < 1) and episodes that end well.

    Args:
        token_level_rewards: ``[B, T]`` (unused).
        loss_mask: ``[B, T]``.
        group_index: ``[B]`` long.
        episode_index, turn_index, turn_rewards: ``[B]``, see the module docstring.
        gamma: discount per turn.
        step_norm: ``mean_norm`` or ``mean_std_norm``.
        eps: keeps the std division finite.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32: the normalised and the raw step return on the
        turn's trained tokens.
    """
    with torch.no_grad():
        valid = episode_index >= 0
        step_returns = discounted_turn_returns(turn_rewards, episode_index, turn_index, gamma)
        advantage = torch.zeros(len(episode_index))
        if valid.any():
            advantage[valid] = _normalised(step_returns[valid], group_index[valid], step_norm, eps)
    return _on_tokens(advantage, step_returns, loss_mask)


def _on_tokens(
    advantage: torch.Tensor, step_returns: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's advantage and step return ``[B]`` on its trained tokens ``[B, T]``, 0 elsewhere."""
    weight = loss_mask.to(torch.float32)
    return advantage.unsqueeze(-1) * weight, step_returns.unsqueeze(-1) * weight
