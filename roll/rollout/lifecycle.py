"""The life of one sample, from request to reward, as the rollout scheduler tracks it.

    queued -> generating -> rewarding -> done -> (kept in a batch | filtered)
        \\__________\\____________\\________> aborted

A sample is *queued* while its prompt waits for a rollout worker with room, *generating* once it is
sent, *rewarding* once its response is back and sent to a reward worker, and *done* when scored. A
done sample ends *filtered* when its group fails a group filter (dynamic sampling). Any unfinished
sample may end *aborted*: surplus requests once a batch is full, requests older than the staleness
bound, or a scheduler that closes. Every transition is timestamped, so the time spent in each stage
is measured per sample (``stage_seconds``).

Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from roll.strategies.requests import GenerateResult

__all__ = ["IllegalTransition", "Sample", "SampleState", "TRANSITIONS", "stage_seconds"]


class SampleState(str, enum.Enum):
    QUEUED = "queued"
    GENERATING = "generating"
    REWARDING = "rewarding"
    DONE = "done"
    FILTERED = "filtered"
    ABORTED = "aborted"


S = SampleState
TRANSITIONS: dict[SampleState, frozenset[SampleState]] = {
    S.QUEUED: frozenset({S.GENERATING, S.ABORTED}),
    S.GENERATING: frozenset({S.REWARDING, S.ABORTED}),
    S.REWARDING: frozenset({S.DONE, S.ABORTED}),
    # A done sample waits in a kept group for its batch; a stale one is still dropped (aborted).
    S.DONE: frozenset({S.FILTERED, S.ABORTED}),
    S.FILTERED: frozenset(),
    S.ABORTED: frozenset(),
}

# The stages whose durations are logged: the time from entering the first state to entering the second.
STAGES = {
    "queue": (S.QUEUED, S.GENERATING),
    "generate": (S.GENERATING, S.REWARDING),
    "reward": (S.REWARDING, S.DONE),
}


class IllegalTransition(RuntimeError):
    """A sample was moved between states that do not follow each other (a scheduler bug)."""


@dataclass
class Sample:
    """One response to be generated for one prompt of a group.

    Attributes:
        request_id: unique id of its generation request (the engine's handle for results and aborts).
        group_id: the group (one drawn prompt) it belongs to.
        index: its place within the group.
        state: where it is in its life.
        times: when it entered each state it has been in (scheduler clock, seconds).
        result: the engine's answer once generated (tokens, logprobs, weight versions).
        response_text: the decoded response the reward scored.
        score: the reward's sequence score once done.
        token_rewards: the reward's per-token (process) rewards, when it gave them.
        reward_info: the rewards' counters for this response (e.g. ``{"timeout": 1.0}``).
    """

    request_id: str
    group_id: int
    index: int
    state: SampleState = SampleState.QUEUED
    times: dict[SampleState, float] = field(default_factory=dict)
    result: GenerateResult | None = None
    response_text: str | None = None
    score: float | None = None
    token_rewards: list[float] | None = None
    reward_info: dict[str, float] = field(default_factory=dict)

    def move(self, state: SampleState, now: float) -> None:
        """Enter ``state`` at time ``now``; raises IllegalTransition for a move the lifecycle forbids."""
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"sample {self.request_id!r} cannot go from {self.state.value} to {state.value}"
            )
        self.state = state
        self.times[state] = now

    @property
    def finished(self) -> bool:
        """No further work will be done on it (done, filtered or aborted)."""
        return self.state in (S.DONE, S.FILTERED, S.ABORTED)


def stage_seconds(sample: Sample) -> dict[str, float]:
    """Seconds the sample spent in each stage it went through (``queue``, ``generate``, ``reward``)."""
    return {
        stage: sample.times[end] - sample.times[start]
        for stage, (start, end) in STAGES.items()
        if start in sample.times and end in sample.times
    }
