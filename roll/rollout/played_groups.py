"""Groups of members played from one item, the core that episodes (``roll.rollout.episodes``) and agent
runs (``roll.rollout.agent_scheduler``) share.

A training group is the ``group_size`` members of one seed that GRPO compares, started with
``redundancy`` spares. Its members keep their start order: the group is its first ``size`` members that
did not fail, complete once they have all ended (the rest are then ended too). Keeping the first to
*end* instead would favour short members (quick failures, quick successes) in every baseline. A group
that can no longer fill is dropped, its seed drawn again (``GroupScheduler._lose``). A held-out group is
one member, kept however it ended.

What a member is and does (an episode with its environment, an agent run with its session) stays with
the scheduler: ``_members`` makes a group's members, ``_start`` starts them, ``_close`` ends what of them
still plays and frees what they hold, and ``_pump`` plays them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from roll.rollout.group_scheduler import GroupScheduler
from roll.strategies.requests import SamplingParams

__all__ = ["Member", "PlayedGroup", "PlayedGroupScheduler"]


class Member(Protocol):
    """An episode or an agent run."""

    @property
    def done(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """It ended by a failure that is not the policy's (an env error, an agent that raised)."""

    @property
    def error(self) -> str | None: ...

    @property
    def versions(self) -> Sequence[int]:
        """The weights version of each token it holds (-1 where no policy sampled it)."""


M = TypeVar("M", bound=Member)


@dataclass(eq=False)  # identity: a group is one object
class PlayedGroup(Generic[M]):
    """The members of one seed, in start order, played on one rollout worker."""

    group_id: int
    seed: int
    members: dict[str, M]
    worker: int
    params: SamplingParams
    training: bool  # a training seed's group (not a held-out member of the evaluation)
    size: int  # members that complete it
    start_version: int  # the weights version when it started
    ended: list[str] = field(default_factory=list)  # the members it keeps, once complete
    closed: bool = False
    complete: bool = False

    @property
    def item(self) -> int:
        """What the seed order drew for it."""
        return self.seed

    @property
    def ready(self) -> bool:
        return self.complete

    def oldest_version(self) -> int:
        """The oldest weights version of any token it sampled (its start version before the first)."""
        versions = [v for member in self.members.values() for v in member.versions if v >= 0]
        return min(versions, default=self.start_version)


class PlayedGroupScheduler(GroupScheduler, Generic[M]):
    """A ``GroupScheduler`` of ``PlayedGroup``s. ``spec`` has ``group_size`` and ``redundancy``;
    ``params`` is a training member's sampling. A subclass gives ``group_type``, ``_members``, ``_start``,
    ``_close`` and ``_pump`` (which begins with ``_begin_round`` and ends settling with ``_settle``)."""

    group_type: type[PlayedGroup] = PlayedGroup
    params: SamplingParams
    backend: Any  # the rollout workers (``num_workers``)

    def __init__(self) -> None:
        super().__init__()
        self._live: list[PlayedGroup[M]] = []  # groups playing (training and evaluation), in draw order
        self._to_start: list[PlayedGroup[M]] = []  # evaluation groups waiting for the next round

    def play(self, seeds: Sequence[int], params: SamplingParams) -> list[M]:
        """One member per seed (held-out evaluation), in seed order, each as it ended (a failed one
        too). With asynchronous training, training groups play on beside them."""
        with self._lock:
            groups = [self._new_group(seed, 1, params, training=False) for seed in seeds]
            self._to_start += groups  # started by the pumping thread: it alone talks to the workers
        self._until(lambda: all(group.closed for group in groups) or None)
        return [next(iter(group.members.values())) for group in groups]

    def close(self) -> None:
        """Stop pumping and end every live group, as far as the workers still answer (after a loss, or
        at shutdown, they may be gone or frozen): nothing here waits for a worker."""
        self._stop_pumping()
        with self._lock:
            for group in list(self._live):
                try:
                    self._close(group)
                except Exception:  # noqa: BLE001 - a lost worker is the pipeline's to replace, not close's
                    self._live = [g for g in self._live if g is not group]
            self._after_close()

    def _after_close(self) -> None:
        """What is left to end once every group is closed."""

    def _begin_round(self) -> None:
        """A round's start, under the lock: drop stale groups, start the evaluation groups waiting, draw
        the training groups wanted and send what waits."""
        self._drop_stale()
        starting, self._to_start = self._to_start, []
        self._start(starting)
        self._draw()
        self._send()

    def _open(self, seeds: list[int]) -> list[PlayedGroup[M]]:
        """Training groups of ``seeds`` with their spares, started (the base draws them)."""
        size = self.spec.group_size + self.spec.redundancy
        groups = [self._new_group(seed, size, self.params, training=True) for seed in seeds]
        self._start(groups)
        return groups

    def _new_group(self, seed: int, count: int, params: SamplingParams, training: bool) -> PlayedGroup[M]:
        group_id = self._new_group_id()
        return self.group_type(
            group_id,
            seed,
            self._members(group_id, seed, count),
            worker=group_id % self.backend.num_workers,
            params=params,
            training=training,
            size=self.spec.group_size if training else 1,
            start_version=self.weights_version,
        )

    def _settle(self, group: PlayedGroup[M], what: str, why: str) -> None:
        """Close ``group`` if it completed or can no longer complete; a training group that cannot is
        lost (``what`` and ``why`` name it in the error past the step's bound) and its seed drawn again."""
        kept = [key for key, member in group.members.items() if not member.failed][: group.size]
        if len(kept) == group.size and all(group.members[key].done for key in kept):
            group.ended = kept
            self._close(group)
            group.complete = True
        elif len(kept) < group.size:
            self._close(group)
            if group.training:  # evaluation keeps the failed member
                errors = [str(m.error) for m in group.members.values() if m.failed and m.error]
                self._lose(group, what, why, errors)

    def _drop(self, group: PlayedGroup[M]) -> None:
        """A stale group, playing or complete: ended if it still plays (the base draws its seed again)."""
        if not group.closed:
            self._close(group)

    @abc.abstractmethod
    def _members(self, group_id: int, seed: int, count: int) -> dict[str, M]:
        """``count`` new members of ``seed``, by id, in start order."""

    @abc.abstractmethod
    def _start(self, groups: list[PlayedGroup[M]]) -> None:
        """Start the groups' members (they join ``_live``)."""

    @abc.abstractmethod
    def _send(self) -> None:
        """Send the work waiting (called under the lock)."""

    @abc.abstractmethod
    def _close(self, group: PlayedGroup[M]) -> None:
        """End the group: mark it closed, take it out of ``_live``, end its members still playing."""
