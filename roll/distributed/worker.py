"""``Worker``: one rank of a role, living in its own Ray actor.

``@register`` marks the methods a Cluster exposes."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ray

from roll.distributed.dispatch import Dispatch
from roll.distributed.liveness import HEALTH_GROUP
from roll.utils.plugins import import_plugins

F = TypeVar("F", bound=Callable[..., Any])
DISPATCH_ATTR = "_roll_dispatch"


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL) -> Callable[[F], F]:
    """Expose a worker method on its Cluster, called on every rank according to ``dispatch``."""

    def decorator(method: F) -> F:
        setattr(method, DISPATCH_ATTR, Dispatch(dispatch))
        return method

    return decorator


def registered_methods(worker_cls: type) -> dict[str, Dispatch]:
    """Name -> dispatch mode for every ``@register``-ed method of ``worker_cls`` and its bases."""
    methods = {}
    for name in dir(worker_cls):
        mode = getattr(getattr(worker_cls, name, None), DISPATCH_ATTR, None)
        if mode is not None:
            methods[name] = mode
    return methods


class Worker:
    """Base class of every role's worker. Subclasses do heavy setup in ``setup``, not ``__init__``,
    so that all clusters start their actors first and load models in parallel."""

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        config: Any,
        env: dict[str, str] | None = None,
        plugins: Sequence[str] = (),
        plugin_path: str | None = None,
    ):
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.config = config
        for key, value in (env or {}).items():
            os.environ[key] = value
        import_plugins(plugins, plugin_path)

    @register(Dispatch.ONE_TO_ALL)
    def setup(self) -> None:
        """Load models and state; called once after all actors exist."""

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> dict[str, Any]:
        """Who and where this rank is: role, rank, process, host, Ray node and devices."""
        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "devices": os.environ.get("ROLL_DEVICES"),
        }

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> tuple[int, str]:
        """Answered from a thread of its own while the main thread computes: the driver's proof that
        this process is alive and not frozen (``roll.distributed.liveness``). Says where it runs."""
        return os.getpid(), socket.gethostname()

    @register(Dispatch.ONE_TO_ALL)
    def warm_up(self) -> None:
        """Import what ``setup`` will need, ahead of it: a standby worker that takes over after a loss
        then starts in the time its own state takes to load. Nothing by default."""

    @register(Dispatch.ONE_TO_ALL)
    def rng_state(self) -> dict[str, Any]:
        """This rank's random generator states (for a checkpoint); one per rank in rank order."""
        from roll.utils import rng

        return rng.capture()

    @register(Dispatch.ONE_TO_ALL)
    def set_rng_state(self, states: Sequence[dict[str, Any]]) -> None:
        """Restore this rank's entry of ``states`` (what ``rng_state`` returned, all ranks in order)."""
        from roll.utils import rng

        if len(states) != self.world_size:
            raise ValueError(
                f"{self.role}: {len(states)} saved random states for {self.world_size} ranks; resume with "
                "the world size the checkpoint was written with"
            )
        rng.restore(states[self.rank])

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        """Release collectives and memory before the actor is killed."""

    def free_port(self) -> int:
        from roll.distributed.ports import free_port

        return free_port()

    @register(Dispatch.RANK_ZERO)
    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0's answer becomes the torch.distributed rendezvous."""
        return ray.util.get_node_ip_address(), self.free_port()
