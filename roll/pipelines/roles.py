"""A pipeline's roles as data, and the one set that starts, keeps standbys of, replaces and stops their
clusters.

A pipeline declares each role it runs (``Role``: worker class, world size, spec, whether its state is
checkpointed, whether a lost one is replaced in place); ``RoleSet`` does the rest the same way for every
pipeline. Where a role's ranks go (devices, placement groups) is the pipeline's ``make`` function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from roll.distributed.cluster import Cluster


@dataclass(frozen=True)
class Role:
    """One role of a pipeline.

    Attributes:
        name: the role's name ("actor", "rollout", ...), used in errors, metrics and device mapping.
        worker: the Worker class of its ranks.
        world_size: how many ranks.
        spec: what each rank receives as its config (a worker spec dataclass).
        trainer: its state (weights, optimizer, RNG) is in every checkpoint; losing it restarts the run
            from the last checkpoint.
        replaceable: it holds no training state, so a lost one is replaced in place and the step goes
            on (rollout, reward, reference workers).
        loads_model: its ``setup`` loads a model when it starts (reward workers load nothing).
    """

    name: str
    worker: type
    world_size: int
    spec: object
    trainer: bool = False
    replaceable: bool = False
    loads_model: bool = True


class RoleSet:
    """The live cluster of each role, and with ``standby`` one idle cluster per role, started ahead and
    warming up, for the next recovery to take.

    Args:
        roles: the run's roles by name (``declare`` may change them on a restart: a new plan).
        make: starts a cluster for a role (placing its ranks).
        standby: keep a standby cluster per role (``checkpoint.standby_workers``).
    """

    def __init__(self, roles: dict[str, Role], make: Callable[[Role], Cluster], standby: bool = False):
        self.roles, self.make, self.standby = roles, make, standby
        self.live: dict[str, Cluster] = {}
        self._standby: dict[str, Cluster] = {}

    def get(self, name: str) -> Cluster | None:
        return self.live.get(name)

    def start(self) -> set[str]:
        """Start every declared role that is not running (a waiting standby first); returns the names
        started. Roles already running (workers that outlived a lost trainer) are kept."""
        started = set()
        for name in self.roles:
            if name not in self.live:
                self.live[name] = self.take(name)
                started.add(name)
        return started

    def take(self, name: str) -> Cluster:
        """A new cluster of role ``name``: its standby if one is waiting."""
        standby = self._standby.pop(name, None)
        return standby if standby is not None else self.make(self.roles[name])

    def replace(self, name: str) -> Cluster:
        """Kill the live cluster of ``name`` and start another in its place."""
        self.live.pop(name).kill()
        self.live[name] = self.take(name)
        return self.live[name]

    def fill_standby(self) -> None:
        """With ``standby``, one started, idle cluster per role, warming up (imports) in the background."""
        if not self.standby:
            return
        for name, role in self.roles.items():
            if name not in self._standby:
                self._standby[name] = self.make(role)
                self._standby[name].warm_up(blocking=False)

    @property
    def standbys(self) -> dict[str, Cluster]:
        return dict(self._standby)

    def stop(self, keep: Iterable[str] = ()) -> None:
        """Kill every live cluster but the roles in ``keep``."""
        kept = set(keep)
        for name in [n for n in self.live if n not in kept]:
            self.live.pop(name).kill()

    def shutdown(self) -> None:
        """Kill every live and standby cluster."""
        self.stop()
        for cluster in self._standby.values():
            cluster.kill()
        self._standby.clear()

    def trainers(self) -> dict[str, Cluster]:
        return {n: c for n, c in self.live.items() if self.roles.get(n) and self.roles[n].trainer}

    def replaceable(self) -> set[str]:
        return {n for n, role in self.roles.items() if role.replaceable}
