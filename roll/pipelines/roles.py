"""A pipeline's roles as data, and the one set that places, starts, colocates, keeps standbys of,
replaces and stops their clusters.

A pipeline declares each role it runs (``Role``: worker class, world size, spec, whether its state is
checkpointed, whether a lost one is replaced in place); ``RoleSet`` does the rest the same way for every
pipeline, and time-shares the devices of colocated roles stage by stage (``on_device``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from roll.distributed.cluster import Cluster
from roll.distributed.colocation import Colocation
from roll.distributed.device_mapping import RoleDevices, colocation_groups
from roll.distributed.liveness import Liveness
from roll.distributed.placement import DeviceTable, RankPlacement, place_role
from roll.pipelines.common import reserve_devices, setup_with_rendezvous


def cluster_options(cfg: Any) -> dict[str, Any]:
    """What every cluster of a run starts with: the call timeout, the plugins its workers import, liveness."""
    return dict(timeout_s=cfg.ray.call_timeout_s, plugins=cfg.imports, liveness=Liveness.from_config(cfg.ray))


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

    @property
    def sequence_parallel_size(self) -> int:
        """Consecutive ranks that share their rows (the spec's ``sequence_parallel_size``; 1 without)."""
        return getattr(self.spec, "sequence_parallel_size", 1)

    def cluster(self, placements: Sequence[RankPlacement] | None, **options: Any) -> Cluster:
        """This role's ranks, started on ``placements`` (None: CPU ranks placed by Ray)."""
        ranks = (self.name, self.worker, self.world_size, self.spec)
        return Cluster(
            *ranks, placements=placements, sequence_parallel_size=self.sequence_parallel_size, **options
        )


class RoleSet:
    """The live cluster of each role, in the order the roles are declared, and with ``standby`` one idle
    cluster per role, started ahead and warming up, for the next recovery to take.

    Args:
        roles: the run's roles by name (the pipeline may declare them again on a restart: a new plan).
        make: starts a cluster for a role (default: its ranks on its devices, see ``place``, started with
            ``cluster_options``).
        standby: keep a standby cluster per role (``checkpoint.standby_workers``).
    """

    def __init__(
        self,
        roles: dict[str, Role],
        make: Callable[[Role], Cluster] | None = None,
        standby: bool = False,
        **cluster_options: Any,
    ):
        self.roles, self.make, self.standby = roles, make or self._start_cluster, standby
        self.cluster_options = cluster_options
        self.live: dict[str, Cluster] = {}
        self._standby: dict[str, Cluster] = {}
        self.devices: dict[str, RoleDevices] = {}
        self.device_table: DeviceTable | None = None
        self.colocation = Colocation({}, [])  # until the roles set up: nothing shares devices

    def place(self, devices: Sequence[RoleDevices], timeout_s: float) -> None:
        """Each role's devices; with any device mapping, a placement group over the cluster's devices pins
        every rank to its devices. Impossible mappings fail here, before any model loads."""
        self.devices = {role.role: role for role in devices}
        self.device_table = reserve_devices(devices, timeout_s)

    def placements(self, name: str) -> list[RankPlacement] | None:
        """Where the ranks of role ``name`` go; None without a device mapping (CPU ranks)."""
        if self.device_table is None or name not in self.devices:
            return None
        return place_role(self.devices[name], self.device_table)

    def _start_cluster(self, role: Role) -> Cluster:
        return role.cluster(self.placements(role.name), **self.cluster_options)

    @contextlib.contextmanager
    def on_device(self, *names: str, metrics: dict[str, float] | None = None) -> Iterator[None]:
        """A stage on the devices of roles ``names``: they are made resident, everything colocated with them
        offloaded (``Colocation.use``), before it runs; what moved is summed into ``metrics``."""
        for key, value in self.colocation.use(*names).items():
            if metrics is not None:
                metrics[key] = metrics.get(key, 0.0) + value
        yield

    def get(self, name: str) -> Cluster | None:
        return self.live.get(name)

    def clusters(self) -> dict[str, Cluster]:
        """The live clusters, in the order the roles are declared."""
        return {name: self.live[name] for name in self.roles if name in self.live}

    def start(self) -> set[str]:
        """Start every declared role that is not running (a waiting standby first); returns the names
        started. Roles already running (workers that outlived a lost trainer) are kept."""
        started = set()
        for name in self.roles:
            if name not in self.live:
                self.live[name] = self.take(name)
                started.add(name)
        return started

    def set_up(self, started: Iterable[str]) -> dict[str, float]:
        """Run the ``setup`` of the roles just ``started`` (a trainer's ranks first agree on a rendezvous).
        Roles that load a model take turns on shared devices: colocated ones load one after another, each
        offloaded before the next loads (``Colocation.start``); the rest set up at once. Returns what
        moved off the devices for them (``offload/<role>_bytes``)."""
        loading = {name: c for name, c in self.clusters().items() if self.roles[name].loads_model}
        previous, moved = self.colocation.on_device, {}
        self.colocation = Colocation(loading, colocation_groups(list(self.devices.values())))
        # Roles that kept running make room first for those that load beside them.
        for group in self.colocation.groups:
            for name in group:
                if name not in started and previous.get(name, True) is False:
                    self.colocation.on_device[name] = False  # offloaded already
            if any(name in started for name in group):
                for name in group:
                    if name not in started and self.colocation.on_device[name]:
                        self.colocation.offload(name, moved)
        setups = {}
        for name in started:
            cluster = self.live[name]
            setup = self._setup(name, cluster)
            if name in loading:
                setups[name] = functools.partial(setup, blocking=False)
            else:
                setup()
        self.colocation.start(setups)
        return moved

    def _setup(self, name: str, cluster: Cluster) -> Callable[..., Any]:
        """A role's ``setup``: ranks that form a process group (trainers, sharded references) first agree
        on a rendezvous."""
        if getattr(self.roles[name].worker, "joins_process_group", False):
            return functools.partial(setup_with_rendezvous, cluster)
        return cluster.setup

    def retire(self, name: str) -> dict[str, float]:
        """Stop role ``name`` for the rest of the run (a teacher whose outputs are cached): its cluster
        is killed, and it no longer takes turns on the devices. Returns what moved back onto them."""
        self.live.pop(name).kill()
        self.roles = {n: role for n, role in self.roles.items() if n != name}
        return self.colocation.forget(name)

    def take(self, name: str) -> Cluster:
        """A new cluster of role ``name``: its standby if one is waiting."""
        standby = self._standby.pop(name, None)
        return standby if standby is not None else self.make(self.roles[name])

    def replace(self, name: str) -> Cluster:
        """Kill the live cluster of ``name`` and start another in its place."""
        self.live.pop(name).kill()
        self.live[name] = self.take(name)
        return self.live[name]

    def renew(self, name: str) -> Cluster:
        """``replace`` a lost role's cluster, set up, in the lost one's place in the devices' turns."""
        cluster = self.replace(name)
        self._setup(name, cluster)()
        if self.roles[name].loads_model:
            self.colocation.clusters[name] = cluster
            if name in self.colocation.on_device:
                self.colocation.on_device[name] = True  # it loaded onto the devices
        return cluster

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
        """Kill every live and standby cluster, then free the devices (for the next job on a shared
        cluster)."""
        self.stop()
        for cluster in self._standby.values():
            cluster.kill()
        self._standby.clear()
        if self.device_table is not None:
            self.device_table.remove()
            self.device_table = None

    def trainers(self) -> dict[str, Cluster]:
        return {n: c for n, c in self.live.items() if self.roles.get(n) and self.roles[n].trainer}

    def replaceable(self) -> set[str]:
        return {n for n, role in self.roles.items() if role.replaceable}
