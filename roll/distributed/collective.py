"""A standalone collective group over torch.distributed, outside the default process group.

Weight transfer needs a group spanning trainer rank 0 and every inference worker, while the trainer ranks
already own a default group (FSDP) and an inference worker may have none. So the group is built directly
from a ``TCPStore`` and a backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``): it never calls
``init_process_group`` and is never registered with torch's global world, which also means the module-level
``torch.distributed.broadcast(..., group=...)`` refuses it ("not registered"). Collectives therefore go
through the backend's own methods, wrapped here with a timeout so that a missing peer is an error, never
a hang.

A group that has failed once (timeout, peer gone) is marked broken: the ranks may now disagree about which
collective comes next, so every later call raises at once. Destroy it and create a new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class CollectiveError(RuntimeError):
    """A collective group could not be created, or one of its operations failed or timed out."""


@dataclass(eq=False)
class CollectiveGroup:
    """One rank's handle on a standalone collective group (see :func:`create_group`).

    ``backend_object`` is the torch backend (``ProcessGroupGloo`` or ``ProcessGroupNCCL``); ``store`` is kept
    referenced because rank 0 hosts the rendezvous server in it, and NCCL exchanges its unique id through it
    at the first collective.
    """

    name: str
    backend: str
    rank: int
    world_size: int
    address: str
    timeout_s: float
    backend_object: Any = field(repr=False)
    store: Any = field(repr=False)
    broken: str | None = None  # why the group is unusable, once it is

    def describe(self) -> str:
        """``group 'name' rank r/n (master host:port)``, for error messages."""
        return f"group {self.name!r} rank {self.rank}/{self.world_size} (master {self.address})"


def _first_line(exc: BaseException) -> str:
    # torch's C++ errors carry multi-line native backtraces; the first line says what happened.
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def create_group(
    name: str,
    backend: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
) -> CollectiveGroup:
    """Join the collective group ``name``; blocks until all ``world_size`` ranks have joined.

    Rank 0 hosts the rendezvous store on ``master_addr:master_port`` (it must be free on that host); the
    others connect to it. ``timeout_s`` bounds the store connection, the rendezvous and, by default, each
    collective. For gloo the full mesh is connected here, so a rank that never comes fails every joined
    rank with :class:`CollectiveError` after about ``timeout_s`` (a client that cannot reach the master at
    all may take up to about twice that: torch retries the connection with backoff). For NCCL the
    communicator is created lazily by the first collective, so a missing peer shows up there instead.
    Gloo picks its network interface from ``GLOO_SOCKET_IFNAME`` or the host name, as torch does.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown collective backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of world size {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    address = f"{master_addr}:{master_port}"
    timeout = timedelta(seconds=timeout_s)
    try:
        # wait_for_workers=False: rank 0 must not block in the store; the backend's rendezvous below waits
        # for everyone (and times out) instead.
        store = dist.TCPStore(
            master_addr, master_port, world_size, rank == 0, timeout, wait_for_workers=False
        )
        # The prefix keeps this group's keys apart should the store ever be shared.
        prefixed = dist.PrefixStore(name, store)
        if backend == "gloo":
            backend_object = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            if not dist.is_nccl_available():
                raise CollectiveError("this torch build has no NCCL")
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout  # torch's own new_group sets the timeout the same way
            backend_object = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    except (RuntimeError, OSError) as exc:
        raise CollectiveError(
            f"could not create collective group {name!r} ({backend}) as rank {rank}/{world_size} with master "
            f"{address} within {timeout_s:g}s: {_first_line(exc)}"
        ) from exc
    return CollectiveGroup(
        name=name,
        backend=backend,
        rank=rank,
        world_size=world_size,
        address=address,
        timeout_s=timeout_s,
        backend_object=backend_object,
        store=store,
    )


def _check_usable(group: CollectiveGroup, what: str) -> None:
    if group.backend_object is None:
        raise CollectiveError(f"{what}: {group.describe()} has been destroyed")
    if group.broken is not None:
        raise CollectiveError(
            f"{what}: {group.describe()} is broken by an earlier failure ({group.broken}); "
            "destroy it and create a new group"
        )


def _wait(group: CollectiveGroup, work: Any, what: str, timeout_s: float, started: float) -> None:
    try:
        # With a timeout, wait() blocks the CPU thread until completion (also for NCCL) or raises.
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        elapsed = time.monotonic() - started
        group.broken = f"{what} failed"
        raise CollectiveError(
            f"{what} failed in {group.describe()} after {elapsed:.1f}s (timeout {timeout_s:g}s): "
            f"{_first_line(exc)}"
        ) from exc


def _run(group: CollectiveGroup, what: str, timeout_s: float, launch: Callable[[], Any]) -> None:
    """Start one collective (``launch`` returns its work handle) on a usable group and wait for it."""
    _check_usable(group, what)
    started = time.monotonic()
    try:
        work = launch()
    except RuntimeError as exc:
        group.broken = f"{what} failed"
        raise CollectiveError(f"{what} failed in {group.describe()}: {_first_line(exc)}") from exc
    _wait(group, work, what, timeout_s, started)


def broadcast(group: CollectiveGroup, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
    """Broadcast ``tensor`` in place from group rank ``src`` to every rank of ``group``.

    Every rank passes a tensor of the same shape and dtype (gloo: on CPU; NCCL: on this rank's GPU).
    Raises :class:`CollectiveError` if the collective fails or does not finish within ``timeout_s``.
    """
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    # Also bound the backend's own operation: after wait() gives up, gloo's worker thread would otherwise
    # stay blocked for the group's default timeout.
    options.timeout = timedelta(seconds=timeout_s)
    _run(
        group,
        f"broadcast from rank {src}",
        timeout_s,
        lambda: group.backend_object.broadcast([tensor], options),
    )


def all_reduce_max(group: CollectiveGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """Replace ``tensor`` in place by its element-wise maximum over all ranks of ``group``.

    Used to agree on a verdict (each rank raises a flag; every rank sees all flags). Raises
    :class:`CollectiveError` on failure or timeout, like :func:`broadcast`.
    """
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    options.timeout = timedelta(seconds=timeout_s)
    _run(group, "all-reduce", timeout_s, lambda: group.backend_object.allreduce([tensor], options))


def destroy_group(group: CollectiveGroup) -> None:
    """Release ``group``'s connections on this rank; safe to call twice and after a failure.

    Uses the backend's ``shutdown()`` (``abort()`` for a broken group, which does not wait for pending
    work) rather than ``destroy_process_group``, which only knows registered groups and has aborted the
    whole process during teardown before. Never raises: it runs in cleanup paths.
    """
    backend_object, group.backend_object = group.backend_object, None
    if backend_object is not None:
        try:
            if group.broken is not None:
                backend_object.abort()
            else:
                backend_object.shutdown()
        except RuntimeError:
            pass  # the peers may already be gone; there is nothing left to release on this side
    # Dropping the store last stops rank 0's rendezvous server once no backend can need it.
    group.store = None
