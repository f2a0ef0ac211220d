"""Deciding whether a failed call is a lost worker the run can recover from, and counting recoveries.

A worker process that died (SIGKILL, OOM killer, a lost node), froze, or let a call time out is a loss:
the controller replaces it and goes on. An exception raised inside a healthy worker is a bug in the
code or the data: a restart would only repeat it, so it ends the run."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from roll.distributed.cluster import Cluster
from roll.distributed.errors import WorkerError, WorkerTimeoutError, WorkerUnresponsiveError
from roll.distributed.weight_sync import WeightSyncError

logger = logging.getLogger(__name__)


def lost_workers(error: BaseException, clusters: Mapping[str, Cluster]) -> dict[str, list[int]]:
    """``role -> ranks`` lost, found by probing every cluster after ``error``; empty when ``error`` is
    not a worker loss (then nothing should be recovered)."""
    if not isinstance(error, (WorkerError, WeightSyncError)):
        return {}
    lost = {role: ranks for role, cluster in clusters.items() if (ranks := cluster.lost_ranks())}
    if not lost and isinstance(error, (WorkerTimeoutError, WorkerUnresponsiveError)):
        lost = {error.role: [error.rank]}  # alive but stuck in the call: as good as lost
    return lost


class RecoveryExhaustedError(RuntimeError):
    """Workers were lost more often than ``checkpoint.max_restarts`` allows."""


def describe(lost: Mapping[str, list[int]]) -> str:
    """``rollout rank 1, actor ranks 0, 1``."""
    parts = [f"{role} rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for role, r in lost.items()]
    return ", ".join(parts)


@dataclass
class RestartBudget:
    """``max_restarts`` recoveries per run; ``restarts`` counts those made (logged as
    ``recovery/restarts``)."""

    max_restarts: int
    restarts: int = 0
    events: list[str] = field(default_factory=list)

    def spend(self, error: BaseException, lost: Mapping[str, list[int]], action: str) -> None:
        """Count one recovery, or re-raise ``error`` when no loss was found or the budget is spent."""
        if not lost:
            raise error
        if self.restarts >= self.max_restarts:
            raise RecoveryExhaustedError(
                f"lost {describe(lost)} after {self.restarts} recoveries (checkpoint.max_restarts="
                f"{self.max_restarts}); giving up. The failure:\n{error}"
            ) from error
        self.restarts += 1
        event = f"recovery {self.restarts}/{self.max_restarts}: lost {describe(lost)}; {action}"
        self.events.append(event)
        logger.warning("%s (%s)", event, str(error).splitlines()[0])
