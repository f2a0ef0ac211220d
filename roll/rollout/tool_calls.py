"""Tool calls inside episodes: their metrics, and a loud stop when most of them fail.

An environment that offers tools (``roll.envs.tool_use``) reports, per step, in ``info["metrics"]``:
``tool_calls`` (1 when the turn called a tool), ``tool_failures`` (the tool returned no result: it
raised, timed out, or its sandbox failed) and ``tool_timeouts``. A malformed call is the policy's format
error (an invalid action), not a tool failure.

A run whose tool calls mostly fail learns nothing about using the tool, and from the reward alone it
looks like a hard task: peers' runs have gone on for days that way. ``ToolFailureMonitor`` stops the run
with the failures' own messages instead.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from roll.rollout.episode import Episode

__all__ = ["ToolFailureError", "ToolFailureMonitor", "tool_metrics"]

# Steps whose calls the monitor pools, and the fewest calls it judges: a step or two of a policy that
# rarely calls the tool says little.
WINDOW_STEPS = 5
MIN_CALLS = 20


class ToolFailureError(RuntimeError):
    """Most tool calls of the last steps failed."""


def _counts(episodes: Sequence[Episode]) -> tuple[int, int, int]:
    """Tool calls, failures and timeouts over every turn of ``episodes``."""
    turns = [turn for episode in episodes for turn in episode.turns]
    keys = ("tool_calls", "tool_failures", "tool_timeouts")
    calls, failures, timeouts = (int(sum(t.metrics.get(key, 0) for t in turns)) for key in keys)
    return calls, failures, timeouts


def tool_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """``<prefix>/use_rate`` (episodes with at least one call), ``calls_per_episode``, ``failure_frac``
    and ``timeout_frac`` (of calls); empty when no turn reported a tool call count (no tool env)."""
    if not any("tool_calls" in turn.metrics for episode in episodes for turn in episode.turns):
        return {}
    calls, failures, timeouts = _counts(episodes)
    n = max(len(episodes), 1)
    used = sum(any(t.metrics.get("tool_calls", 0) for t in episode.turns) for episode in episodes)
    return {
        f"{prefix}/use_rate": used / n,
        f"{prefix}/calls_per_episode": calls / n,
        f"{prefix}/failure_frac": failures / max(calls, 1),
        f"{prefix}/timeout_frac": timeouts / max(calls, 1),
    }


class ToolFailureMonitor:
    """Raises ``ToolFailureError`` once more than ``max_failure_frac`` of the tool calls of the last
    ``WINDOW_STEPS`` steps failed (judged from ``MIN_CALLS`` calls on), quoting failed calls' outputs."""

    def __init__(self, max_failure_frac: float | None):
        self.max_failure_frac = max_failure_frac
        self._steps: collections.deque[tuple[int, int]] = collections.deque(maxlen=WINDOW_STEPS)
        self._examples: collections.deque[str] = collections.deque(maxlen=3)  # the latest failures' outputs

    def observe(self, episodes: Sequence[Episode]) -> None:
        if self.max_failure_frac is None:
            return
        calls, failures, _ = _counts(episodes)
        self._steps.append((calls, failures))
        self._examples.extend(_failed_outputs(episodes))
        calls = sum(c for c, _ in self._steps)
        failures = sum(f for _, f in self._steps)
        if calls >= MIN_CALLS and failures > self.max_failure_frac * calls:
            examples = list(self._examples)
            raise ToolFailureError(
                f"{failures} of the last {calls} tool calls failed (over {len(self._steps)} steps; "
                f"env.max_tool_failure_frac={self.max_failure_frac:g}): the tool itself is failing, not "
                f"the policy. What failed calls returned: {examples or 'nothing'}. Fix the tool (its "
                "sandbox, timeout or service), or raise env.max_tool_failure_frac"
            )


def _failed_outputs(episodes: Sequence[Episode], most: int = 3) -> list[str]:
    """What the env showed after failed calls (the observation following each), up to ``most``."""
    outputs: list[str] = []
    for episode in episodes:
        for k, turn in enumerate(episode.turns):
            if turn.metrics.get("tool_failures") and len(outputs) < most:
                last = k + 1 == len(episode.turns)
                outputs.append((episode.observation if last else episode.turns[k + 1].observation)[:200])
    return outputs
