"""What a batch of episodes did: success, return, turns, invalid actions, tokens, stop reasons, tool
calls and the action histogram (a policy collapsing onto one action shows there first); and what the
episode scheduler saw meanwhile: env failures, dropped and stale groups, staleness."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from roll.rollout.episode import Episode, StopReason, Turn
from roll.rollout.tool_calls import tool_metrics

__all__ = ["episode_metrics", "scheduler_metrics"]

# At most this many distinct actions get a histogram entry (a policy writing free text would make one
# per turn); the rest are counted under actions/other.
MAX_ACTION_KEYS = 16


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """Success rate, return, turns, invalid-action rate, tokens, stop reasons and the action histogram
    of ``episodes`` (the histogram catches a policy that repeats one action)."""
    n = max(len(episodes), 1)
    turns = [turn for episode in episodes for turn in episode.turns]
    metrics = {
        f"{prefix}/success": sum(e.success for e in episodes) / n,
        f"{prefix}/return": sum(e.episode_return for e in episodes) / n,
        f"{prefix}/turns": len(turns) / n,
        # A turn the env did not act on (no stop id within the turn's budget) is no valid action either.
        f"{prefix}/invalid_action_frac": sum(_label(t) in ("invalid", "unfinished") for t in turns)
        / max(len(turns), 1),
        f"{prefix}/response_tokens": sum(len(e.response_ids) for e in episodes) / n,
    }
    reasons = collections.Counter(e.stop_reason.value for e in episodes if e.stop_reason is not None)
    training = prefix == "episode"
    metrics.update(tool_metrics(episodes, "tool" if training else f"{prefix}/tool"))
    for reason in StopReason:  # every reason in training; in evaluation the ones that occurred
        if training or reasons[reason.value]:
            metrics[f"{prefix}/stop/{reason.value}"] = reasons[reason.value] / n
    if training:  # the histogram of training turns
        actions = collections.Counter(_label(turn) for turn in turns)
        common = dict(actions.most_common(MAX_ACTION_KEYS))
        for action, count in common.items():
            metrics[f"actions/{action}"] = count / max(len(turns), 1)
        other = sum(actions.values()) - sum(common.values())
        if other:
            metrics["actions/other"] = other / len(turns)
    return metrics


def _label(turn: Turn) -> str:
    """A turn in the action histogram: its text, ``invalid`` (the env refused it) or ``unfinished`` (cut
    by the turn's token budget: never acted on)."""
    if not turn.acted:
        return "unfinished"
    return turn.text.strip() if turn.action_is_valid else "invalid"


def scheduler_metrics(
    episodes: Sequence[Episode], counts: Mapping[str, int], env_seconds: Sequence[float], weights_version: int
) -> dict[str, float]:
    """The env calls' failure rates and time, the groups dropped, aborted and stale (``counts`` since the
    last batch), and how many weights versions behind ``weights_version`` each episode's oldest token is."""
    calls = max(counts.get("env_calls", 0), 1)
    oldest = [min((v for v in e.versions if v >= 0), default=weights_version) for e in episodes]
    staleness = [weights_version - version for version in oldest]
    return {
        "env/error_frac": counts.get("env_errors", 0) / calls,
        "env/timeout_frac": counts.get("env_timeouts", 0) / calls,
        "env/retried_frac": counts.get("env_retried", 0) / calls,
        # From sending an episode's step to taking its result: the env's time plus the call's.
        "env/step_s": sum(env_seconds) / max(len(env_seconds), 1),
        "rollout/dropped_groups": float(counts.get("dropped_groups", 0)),
        "rollout/aborted_episodes": float(counts.get("aborted_episodes", 0)),
        "rollout/stale_groups": float(counts.get("stale_groups", 0)),
        "rollout/staleness_mean": sum(staleness) / max(len(staleness), 1),
        "rollout/staleness_max": float(max(staleness, default=0)),
    }
