"""Keeping an RL run's workers: lost workers that hold no training state are replaced in place and the
call that found the loss runs again, so no step is lost or repeated.

Rollout, reward, reference, teacher and environment workers hold nothing a checkpoint would restore
(``Role.replaceable``): a loss of one is found when a call fails (``WorkerError``: a dead, frozen or
timed-out rank, ``roll.pipelines.recovery.lost_workers``), counted against ``checkpoint.max_restarts``,
and the role's cluster is replaced (by its standby when ``checkpoint.standby_workers`` keeps one). A lost
trainer (actor, critic) stops the run loop's step: it restarts the workers (``restart_workers``) and
loads the last checkpoint (``RunLoop._restart``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from roll.distributed.cluster import WorkerError
from roll.distributed.weight_sync import WeightSync, WeightSyncError
from roll.pipelines.recovery import RestartBudget, lost_workers
from roll.pipelines.roles import RoleSet
from roll.pipelines.weight_publisher import WeightPublisher
from roll.utils.signals import set_activity

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Supervisor:
    """Args:
    roles: the run's role set (its live clusters, standbys and devices).
    budget: the run's recoveries, shared with the run loop's restarts.
    publisher: the weight transfer; rollout workers that replace lost ones get the trained weights.
    weight_sync: a new transfer from the actor to the live rollout workers (not yet connected).
    rollout_side: roles the rollout scheduler depends on (rollout, reward or environment workers).
    rebuild_scheduler: ``with rebuild_scheduler(keeps_rollout):`` closes the scheduler, then starts it again
        from its state (the pipeline's: it makes schedulers), so the work in flight is done again.
    """

    def __init__(
        self,
        roles: RoleSet,
        budget: RestartBudget,
        publisher: WeightPublisher,
        weight_sync: Callable[[], WeightSync],
        rollout_side: frozenset[str],
        rebuild_scheduler: Callable[[bool], AbstractContextManager[Any]],
    ):
        self.roles, self.budget, self.publisher, self.weight_sync = roles, budget, publisher, weight_sync
        self.rollout_side, self.rebuild_scheduler = rollout_side, rebuild_scheduler

    def guard(self, call: Callable[[], T]) -> T:
        """``call()``; when it fails because replaceable workers were lost, they are replaced and ``call``
        runs again. Any other failure (a lost trainer among them) is raised."""
        while True:
            try:
                return call()
            except (WorkerError, WeightSyncError) as error:
                lost = lost_workers(error, self.roles.clusters())
                if not lost or not set(lost) <= self.roles.replaceable():
                    raise
                self.budget.spend(error, lost, f"replacing {' and '.join(sorted(lost))} workers")
                self.replace(set(lost))

    def replace(self, roles: set[str]) -> None:
        """New clusters in place of the lost ``roles``, set up: roles outside the rollout side (the
        reference, distillation's teachers) load their model again; a loss on the rollout side rebuilds
        the scheduler around the replacement, and new rollout workers get a new weight transfer and the
        trained weights."""
        set_activity(f"replacing lost {' and '.join(sorted(roles))} workers")
        start = time.perf_counter()
        for name in sorted(roles - self.rollout_side):
            self.roles.renew(name)
        if roles & self.rollout_side:
            with self.rebuild_scheduler("rollout" not in roles):
                for name in sorted(roles & self.rollout_side - {"rollout"}):
                    self.roles.renew(name)
                if "rollout" in roles:
                    self.publisher.close()
                    self.roles.renew("rollout")
                    self.publisher.reconnect(self.weight_sync())
        logger.warning(
            "replaced the %s workers in %.1f s%s",
            " and ".join(sorted(roles)),
            time.perf_counter() - start,
            " (standby processes)" if self.roles.standby else "",
        )
        self.roles.fill_standby()

    def restart_workers(
        self, lost: dict[str, list[int]], stop: Callable[[set[str]], None], start: Callable[[], None]
    ) -> str:
        """Every worker started again (the pipeline's ``stop(keep)``, then ``start()``), but stateless ones
        that still answer: they hold nothing of the lost history that a weight sync and a new scheduler do
        not replace, and keeping them saves their start-up. Returns how long each part took."""
        began = time.perf_counter()
        stop(self.roles.replaceable() - set(lost))
        stopped = time.perf_counter()
        start()
        starting = time.perf_counter() - stopped
        return f"stopping the workers {stopped - began:.1f} s, starting them {starting:.1f} s"
