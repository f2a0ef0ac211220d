"""What the episode scheduler (``roll.rollout.episodes``) plays: the spec of a step's groups, and one
group of episodes from one seed with its bookkeeping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from roll.rollout.episode import Episode, EpisodeBudget
from roll.rollout.played_groups import PlayedGroup


@dataclass(frozen=True)
class EpisodeSpec:
    """What one step gathers: ``groups_per_step`` groups of ``group_size`` episodes (``redundancy``
    extra started per group), each within ``budget``. ``history_turns`` None: one sample per episode;
    a number: one sample per turn, each turn generated from that many turns of history (step-wise), the
    batch padded to a multiple of ``divisor`` rows. ``async_generation_ratio``: steps played ahead while
    the actor trains (0: synchronous)."""

    groups_per_step: int
    group_size: int
    budget: EpisodeBudget
    redundancy: int = 0
    stop_policy: Mapping[str, str] = field(default_factory=dict)  # stop reason -> train, mask or zero
    history_turns: int | None = None
    divisor: int = 1
    max_tool_failure_frac: float | None = None  # stop when more tool calls fail (ToolFailureMonitor)
    async_generation_ratio: int = 0

    @property
    def max_dropped_groups(self) -> int:
        """Dropped groups one step tolerates; one more stops the step, and the run, with the env's error."""
        return 4 * self.groups_per_step + 8


@dataclass(eq=False)  # identity: a group is one object
class EpisodeGroup(PlayedGroup[Episode]):
    """The episodes of one seed (``members``), played on one rollout worker; complete once its first
    ``size`` episodes in start order that did not fail have ended."""

    released: set[str] = field(default_factory=set)  # episodes whose kept KV the engine was told to free
