"""Watching the ranks a driver call waits on, so that nothing hangs silently.

A call's own time limit (``ray.call_timeout_s``) must allow for the slowest legitimate work, so it is
long (15 minutes by default). Within it, two things keep the operator informed:

- **Heartbeats.** Every worker answers ``heartbeat`` in a thread of its own (the ``health`` concurrency
  group), beside whatever its main thread computes. While a call runs longer than a third of
  ``ray.liveness_timeout_s``, the driver sends heartbeats to the ranks it still waits on; a rank that
  has answered before and leaves a heartbeat unanswered for ``liveness_timeout_s`` is frozen (stopped
  with SIGSTOP, deadlocked while holding the interpreter lock, swapping to a standstill), and the call
  raises ``WorkerUnresponsiveError`` naming it. A rank that never answered yet may still be starting
  (its actor waiting for resources), so silence there is reported as progress, not as a failure.
- **Progress lines.** Every ``ray.progress_every_s`` a waiting call logs which ranks it still waits on,
  for how long, and whether they answer heartbeats (busy) or not.

Short calls pay nothing: no heartbeat is sent before a third of the liveness timeout has passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

from roll.distributed.errors import WorkerUnresponsiveError

HEALTH_GROUP = "health"
# How often a waiting call wakes up to look at heartbeats and progress, in seconds.
POLL_S = 1.0
# What a watch reads the time from (its start, each poll). Tests replace it to step a watch through time
# at a pace of their own, independent of how busy the machine is.
clock: Callable[[], float] = time.monotonic

logger = logging.getLogger("roll")


@dataclass(frozen=True)
class Liveness:
    """How long a silent rank is tolerated, and how often a long call reports progress (0 disables)."""

    timeout_s: float = 30.0
    progress_every_s: float = 60.0

    @classmethod
    def from_config(cls, ray_cfg: Any) -> Liveness:
        """From a config's ``ray`` section."""
        return cls(timeout_s=ray_cfg.liveness_timeout_s, progress_every_s=ray_cfg.progress_every_s)

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 or self.progress_every_s > 0


@dataclass
class RankHealth:
    """What the driver knows of one rank between calls: whether it ever answered (so silence means
    frozen, not still starting), where its process is, and whether it was found frozen."""

    answered: bool = False
    process: str | None = None  # "pid 1234 on host-a", from its heartbeats
    frozen: bool = False


@dataclass
class WatchedRank:
    """One rank a call waits on, and the method it runs there."""

    role: str
    rank: int
    method: str
    handle: Any  # the rank's actor handle
    health: RankHealth
    beat: Any = None  # the heartbeat in flight
    beat_sent: float = 0.0  # when the last heartbeat was sent
    answered_beat: bool = False  # a heartbeat of this call came back


class RankWatch:
    """Heartbeats and progress for one call, or for several calls waited on together (weight sync).

    The waiting loop calls ``poll(pending)`` at least every ``poll_every_s`` with the ``(role, rank)``
    pairs that have not answered yet, and ``answered(role, rank)`` for each one that has."""

    def __init__(self, ranks: Sequence[WatchedRank], liveness: Liveness):
        self.liveness = liveness
        self.started = clock()
        self._ranks = {(r.role, r.rank): r for r in ranks}
        self._next_progress = self.started + liveness.progress_every_s
        # Heartbeats start, and repeat, after a third of the timeout: short calls send none.
        self._beat_every = liveness.timeout_s / 3

    @classmethod
    def combine(cls, *watches: RankWatch) -> RankWatch:
        """One watch over the ranks of several calls that are waited on together."""
        return cls([r for w in watches for r in w._ranks.values()], watches[0].liveness)

    @property
    def poll_every_s(self) -> float | None:
        """How long the waiting loop may block between polls (None: it need not poll at all)."""
        return POLL_S if self.liveness.enabled else None

    def answered(self, role: str, rank: int) -> None:
        """The rank returned its result: it is alive (and known to answer from now on)."""
        self._ranks[(role, rank)].health.answered = True

    def poll(self, pending: Iterable[tuple[str, int]]) -> None:
        """Collect heartbeats, send new ones, raise for a frozen rank, log progress when due."""
        now = clock()
        waiting = [self._ranks[key] for key in pending]
        if self.liveness.timeout_s > 0:
            for watched in waiting:
                self._check(watched, now)
        if self.liveness.progress_every_s > 0 and now >= self._next_progress:
            self._next_progress = now + self.liveness.progress_every_s
            for watched in waiting:
                self._log_progress(watched, now)

    def _check(self, watched: WatchedRank, now: float) -> None:
        if watched.beat is not None and ray.wait([watched.beat], timeout=0)[0]:
            try:
                pid, host = ray.get(watched.beat)
                watched.health.answered = True
                watched.health.process = f"pid {pid} on {host}"
                watched.answered_beat = True
            except RayError:
                pass  # the process died: the call itself fails and says so
            watched.beat = None
        unanswered = now - watched.beat_sent if watched.beat is not None else 0.0
        # A heartbeat outstanding for the whole timeout, to a rank known to answer: frozen. Measured from
        # the heartbeat's sending, so a slow poll of the driver never makes a live rank look silent.
        if watched.health.answered and unanswered > self.liveness.timeout_s:
            watched.health.frozen = True
            process = watched.health.process or "its process"
            raise WorkerUnresponsiveError(
                watched.role,
                watched.rank,
                watched.method,
                f"the worker stopped answering: a heartbeat went unanswered for {unanswered:.0f} s "
                f"(ray.liveness_timeout_s={self.liveness.timeout_s:g}). The process is alive but frozen: "
                f"stopped (SIGSTOP), deadlocked in native code, or swapping; `py-spy dump` of {process} "
                "shows where it is",
            )
        if watched.beat is None and now - max(self.started, watched.beat_sent) >= self._beat_every:
            watched.beat = watched.handle.heartbeat.remote()
            watched.beat_sent = now

    def _log_progress(self, watched: WatchedRank, now: float) -> None:
        unanswered = now - watched.beat_sent if watched.beat is not None else 0.0
        if self.liveness.timeout_s <= 0:
            state = ""
        elif not watched.health.answered:
            state = " (not answered yet: still starting or waiting for resources)"
        elif unanswered > 2 * POLL_S:
            state = f" (a heartbeat unanswered for {unanswered:.0f} s)"
        elif watched.answered_beat:
            state = " (answering heartbeats: busy, not frozen)"
        else:
            state = ""  # no heartbeat asked for yet
        logger.warning(
            f"roll: still waiting for {watched.role} rank {watched.rank} in {watched.method}() after "
            f"{now - self.started:.0f} s{state}"
        )
