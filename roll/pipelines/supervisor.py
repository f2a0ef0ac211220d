"""Keeping an RL run's workers: lost workers that hold no training state are replaced in place and the
call that found the loss runs again, so no step is lost or repeated.

Rollout, reward, reference, teacher and environment workers hold nothing a checkpoint would restore
(``Role.replaceable``): a loss of one is found when a call fails (``WorkerError``: a dead, frozen or
timed-out rank, ``roll.pipelines.recovery.lost_workers``), counted against ``checkpoint.max_restarts``,
and the role's cluster is replaced (by its standby when ``checkpoint.standby_workers`` keeps one). A lost
trainer (actor, critic) is not this module's: the run loop restarts every worker from the last checkpoint
(``RunLoop._restart``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from roll.config.devices import TEACHER_PREFIX
from roll.distributed.cluster import Cluster, WorkerError
from roll.distributed.colocation import Colocation
from roll.distributed.weight_sync import WeightSyncError
from roll.pipelines.recovery import RestartBudget, lost_workers
from roll.pipelines.roles import RoleSet
from roll.utils.signals import set_activity

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Supervisor:
    """Args:
    roles: the run's role set (its live clusters and standbys).
    budget: the run's recoveries, shared with the run loop's restarts.
    colocation: the run's colocation (a replacement takes its role's place in it).
    rollout_side: roles the rollout scheduler depends on (rollout workers, reward or environment
        workers): after such a loss the scheduler starts again from its state.
    rebuild_rollout_side: replaces those of them that were lost and the scheduler (the pipeline's: it
        owns the scheduler and the weight transfer).
    """

    def __init__(
        self,
        roles: RoleSet,
        budget: RestartBudget,
        colocation: Callable[[], Colocation],
        rollout_side: frozenset[str],
        rebuild_rollout_side: Callable[[set[str]], None],
    ):
        self.roles, self.budget, self.colocation = roles, budget, colocation
        self.rollout_side, self.rebuild_rollout_side = rollout_side, rebuild_rollout_side

    def clusters(self) -> dict[str, Cluster]:
        """The live clusters, in the order the roles are declared."""
        live = self.roles.live
        return {name: live[name] for name in self.roles.roles if name in live}

    def guard(self, call: Callable[[], T]) -> T:
        """``call()``; when it fails because replaceable workers were lost, they are replaced and ``call``
        runs again. Any other failure (a lost trainer among them) is raised."""
        while True:
            try:
                return call()
            except (WorkerError, WeightSyncError) as error:
                lost = lost_workers(error, self.clusters())
                if not lost or not set(lost) <= self.roles.replaceable():
                    raise
                self.budget.spend(error, lost, f"replacing {' and '.join(sorted(lost))} workers")
                self.replace(set(lost))

    def replace(self, roles: set[str]) -> None:
        """New clusters in place of the lost ``roles``. Model holders with no state but the model they
        loaded (the reference, distillation's teachers) load it again; the rollout side is the
        pipeline's to rebuild."""
        set_activity(f"replacing lost {' and '.join(sorted(roles))} workers")
        start = time.perf_counter()
        for name in sorted(r for r in roles if r == "reference" or r.startswith(TEACHER_PREFIX)):
            cluster = self.roles.replace(name)
            cluster.setup()
            self.colocation().clusters[name] = cluster
        if roles & self.rollout_side:
            self.rebuild_rollout_side(roles)
        logger.warning(
            "replaced the %s workers in %.1f s%s",
            " and ".join(sorted(roles)),
            time.perf_counter() - start,
            " (standby processes)" if self.roles.standby else "",
        )
        self.roles.fill_standby()
