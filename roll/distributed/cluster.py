"""``Cluster``: the N Ray actors of one role, driven from the single controller as one object.

Driver code calls ``cluster.method(batch)`` and never touches Ray handles: every ``@register``-ed worker
method becomes a Cluster method that splits its arguments per the dispatch mode, calls every rank,
waits with a timeout and merges the results. An exception on any rank is raised in the driver as one
``WorkerError`` naming the role, the rank, the method and carrying the remote traceback. While a call
waits, the ranks it waits on are watched (``roll.distributed.liveness``): a frozen one fails the call
with ``WorkerUnresponsiveError`` and long calls log their progress.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from roll.distributed.dispatch import Dispatch, dispatch_mode
from roll.distributed.errors import WorkerError, WorkerTimeoutError, WorkerUnresponsiveError
from roll.distributed.liveness import HEALTH_GROUP, Liveness, RankHealth, RankWatch, WatchedRank
from roll.distributed.placement import RankPlacement
from roll.distributed.worker import Worker, registered_methods

__all__ = [
    "Cluster",
    "ClusterFuture",
    "WorkerError",
    "WorkerTimeoutError",
    "WorkerUnresponsiveError",
    "caller_signature",
    "wait_all",
    "wait_any",
    "wait_for_ranks",
]


class ClusterFuture:
    """Pending results of one Cluster call; ``get()`` waits (with the cluster's timeout, watching the
    ranks' heartbeats) and merges them.

    ``ranks`` names the rank of each ref when they are not 0..n-1 (a call on one rank), so errors name
    the rank that failed. ``deadline`` (``time.monotonic()`` at creation plus ``timeout_s``) is when the
    call is overdue for ``wait_any``, which waits on many calls at once and cannot restart a timeout
    for each."""

    def __init__(
        self,
        refs: list[ray.ObjectRef],
        collect: Callable[[list[Any]], Any],
        role: str,
        method: str,
        timeout_s: float,
        watch: RankWatch | None = None,
        ranks: Sequence[int] | None = None,
    ):
        if ranks is not None and len(ranks) != len(refs):
            raise ValueError(f"{len(ranks)} ranks given for {len(refs)} refs")
        self.refs, self._collect = refs, collect
        self.role, self.method, self.timeout_s = role, method, timeout_s
        self.watch = watch
        self.ranks: list[int] = list(ranks) if ranks is not None else list(range(len(refs)))
        self.deadline = time.monotonic() + timeout_s

    def get(self) -> Any:
        return self._collect(
            wait_for_ranks(self.refs, self.role, self.method, self.timeout_s, self.ranks, self.watch)
        )


def wait_for_ranks(
    refs: list[ray.ObjectRef],
    role: str,
    method: str,
    timeout_s: float,
    ranks: Sequence[int] | None = None,
    watch: RankWatch | None = None,
) -> list[Any]:
    """Results in order of ``refs`` (rank order; ``ranks`` names the ranks when they are not 0..n-1).
    Raises on the first rank that fails, without waiting for the others, so a crashed rank is reported
    at once instead of after the peers blocked on it time out. With a ``watch``, a rank that stops
    answering heartbeats fails the call long before ``timeout_s`` and long calls log their progress."""
    rank_of = dict(zip(refs, ranks if ranks is not None else range(len(refs)), strict=True))
    results: dict[int, Any] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    poll_s = watch.poll_every_s if watch is not None else None
    while pending:
        remaining = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(min(remaining, poll_s or remaining), 0))
        if not ready:
            if time.monotonic() < deadline:
                watch.poll((role, rank_of[r]) for r in pending)  # type: ignore[union-attr]
                continue
            ranks = sorted(rank_of[r] for r in pending)
            raise WorkerTimeoutError(
                role,
                ranks[0],
                method,
                f"no answer after {timeout_s:.0f} s from rank(s) {ranks} "
                "(raise ray.call_timeout_s if this work is legitimately slow)",
            )
        ref = ready[0]
        try:
            results[rank_of[ref]] = ray.get(ref)
        except RayTaskError as e:
            raise WorkerError(role, rank_of[ref], method, str(e)) from None
        except RayActorError as e:
            raise WorkerError(role, rank_of[ref], method, f"the worker process died: {e}") from None
        except (GetTimeoutError, RayError) as e:
            raise WorkerError(role, rank_of[ref], method, repr(e)) from None
        if watch is not None:
            watch.answered(role, rank_of[ref])
    return [results[rank_of[ref]] for ref in refs]


class Cluster:
    """All ranks of one role. Registered worker methods are available as attributes."""

    def __init__(
        self,
        role: str,
        worker_cls: type[Worker],
        world_size: int,
        config: Any,
        timeout_s: float = 900.0,
        num_cpus_per_worker: float = 0.0,
        num_gpus_per_worker: float = 0.0,
        env: dict[str, str] | None = None,
        plugins: Sequence[str] = (),
        placements: Sequence[RankPlacement] | None = None,
        liveness: Liveness | None = None,
        sequence_parallel_size: int = 1,
    ):
        """``plugins``: modules every worker imports at start (a config's ``imports``), found from the
        driver's working directory as well as the installed packages. ``placements`` (from
        ``placement.place_role``, one per rank) pins each rank to its devices; without them Ray places the
        actors freely and they see no GPU (CPU-only roles). A worker class may declare ``concurrency_groups``
        (name -> threads) for methods marked ``@ray.method(concurrency_group=...)``: those run beside the rest
        (e.g. an abort reaching a rollout engine while it generates); every worker also answers heartbeats
        that way. ``liveness`` says how long a silent rank is tolerated while a call waits on it and how often
        long calls report progress (``roll.distributed.liveness``). ``sequence_parallel_size``: each run of
        that many consecutive ranks shares its rows (``dispatch_mode``)."""
        if world_size < 1:
            raise ValueError(f"{role}: world_size must be >= 1 (got {world_size})")
        if placements is not None and len(placements) != world_size:
            raise ValueError(f"{role}: {len(placements)} placements given for world_size {world_size}")
        if world_size % sequence_parallel_size:
            raise ValueError(
                f"{role}: sequence_parallel_size {sequence_parallel_size} does not divide "
                f"world_size {world_size}"
            )
        self.role, self.world_size, self.timeout_s = role, world_size, timeout_s
        self.sequence_parallel_size = sequence_parallel_size
        # Fractional/zero CPU requests: the stages of one step run one after another, so actors
        # time-share the cores instead of each reserving one (a 2-core laptop holds every role).
        groups = {HEALTH_GROUP: 1, **getattr(worker_cls, "concurrency_groups", {})}
        remote_cls = ray.remote(
            num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker, concurrency_groups=groups
        )(worker_cls)
        self.liveness = liveness or Liveness()
        self.health = [RankHealth() for _ in range(world_size)]
        self.workers = []
        for rank in range(world_size):
            # Every other method runs on one thread: torch's CPU thread pool belongs to its calling thread,
            # so compute spread over several threads would start several pools competing for the cores.
            options: dict[str, Any] = {"name": None, "max_concurrency": 1}
            rank_env = env
            if placements is not None:
                options.update(placements[rank].options)
                # The placement's CUDA_VISIBLE_DEVICES wins over Ray's one-GPU default and the caller's env.
                rank_env = {**(env or {}), **placements[rank].env}
            elif num_gpus_per_worker == 0:
                # A CPU rank never sees a GPU: Ray leaves an actor that asks for none every GPU of its
                # node, and torch would put every such rank on cuda:0.
                rank_env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ""}
            self.workers.append(
                remote_cls.options(**options).remote(
                    role, rank, world_size, config, rank_env, tuple(plugins), os.getcwd()
                )
            )
        self.worker_cls = worker_cls
        self._methods = registered_methods(worker_cls)
        for name, mode in self._methods.items():
            setattr(self, name, self._make_caller(name, mode))

    def _make_caller(self, name: str, mode: Dispatch) -> Callable[..., Any]:
        dispatch = dispatch_mode(mode, self.sequence_parallel_size)

        def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
            per_rank = dispatch.split(self.world_size, args, kwargs)
            pairs = zip(self.workers, per_rank, strict=True)
            refs = [getattr(w, name).remote(*a, **k) for w, (a, k) in pairs]
            future = ClusterFuture(refs, dispatch.collect, self.role, name, self.timeout_s, self.watch(name))
            return future.get() if blocking else future

        # Document the caller from the worker class's own method (not the base Worker's, which most
        # methods do not exist on), so help(cluster.method) shows what the role's method does.
        method = getattr(self.worker_cls, name)
        call.__name__ = name
        call.__qualname__ = f"{type(self).__name__}[{self.worker_cls.__name__}].{name}"
        usage = f"Dispatch: {mode.value}; pass blocking=False to get a ClusterFuture."
        call.__doc__ = f"{inspect.getdoc(method) or ''}\n\n{usage}".strip()
        call.__signature__ = caller_signature(method)  # type: ignore[attr-defined]
        return call

    def call_rank(
        self,
        rank: int,
        method: str,
        *args: Any,
        blocking: bool = True,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call ``method`` on one rank only: any public method of the worker, registered or not (the
        single requests a scheduler sends to the rollout worker it picked, e.g. ``submit_many``).

        Returns that rank's result, or with ``blocking=False`` a ClusterFuture whose ``get()`` does.
        ``timeout_s`` defaults to the cluster's; failures and timeouts name role, rank and method.

        Raises:
            ValueError: ``rank`` is not in 0..world_size-1.
            AttributeError: the worker class has no public method ``method``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}: rank {rank} is out of range for world_size {self.world_size}")
        if method.startswith("_") or not callable(getattr(self.worker_cls, method, None)):
            raise AttributeError(f"{self.worker_cls.__name__} ({self.role}) has no public method {method!r}")
        ref = getattr(self.workers[rank], method).remote(*args, **kwargs)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        future = ClusterFuture([ref], _only, self.role, method, timeout, self.watch(method, [rank]), [rank])
        return future.get() if blocking else future

    def watch(self, method: str, ranks: Sequence[int] | None = None) -> RankWatch:
        """Heartbeats and progress for a call of ``method`` waiting on ``ranks`` (default: all)."""
        ranks = range(self.world_size) if ranks is None else ranks
        watched = [WatchedRank(self.role, r, method, self.workers[r], self.health[r]) for r in ranks]
        return RankWatch(watched, self.liveness)

    def lost_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks whose process is gone or does not answer a heartbeat within ``timeout_s``. Heartbeats
        are answered beside running work, so a busy rank is not lost; a silent one is marked frozen, so
        that ``kill`` ends it without asking it first."""
        refs = {worker.heartbeat.remote(): rank for rank, worker in enumerate(self.workers)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        lost = {rank for ref, rank in refs.items() if ref not in ready}
        for rank in lost:
            self.health[rank].frozen = True
        for ref in ready:
            try:
                ray.get(ref)
            except RayError:
                lost.add(refs[ref])
        return sorted(lost)

    def discard(self, futures: Sequence[ClusterFuture], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for ``futures`` (calls of this cluster) to end, then drop them: their
        results and errors are never read. For a caller that stops using the calls it has in flight
        but must not leave them running into whoever calls these ranks next."""
        refs = list(dict.fromkeys(ref for future in futures for ref in future.refs))  # ray.wait: unique
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def kill(self) -> None:
        """Ask every rank to release its resources, then end the actors."""
        # A frozen rank would only make everyone wait for its answer: it is killed without asking.
        answering = [rank for rank in range(self.world_size) if not self.health[rank].frozen]
        try:
            refs = [self.workers[rank].shutdown.remote() for rank in answering]
            wait_for_ranks(refs, self.role, "shutdown", 10.0, answering)
        except WorkerError:
            pass  # a worker that cannot shut down cleanly is killed below all the same
        kill_actors(self.workers)

    def __repr__(self) -> str:
        return f"Cluster(role={self.role!r}, world_size={self.world_size}, methods={sorted(self._methods)})"


def caller_signature(method: Callable[..., Any]) -> inspect.Signature:
    """The worker method's signature without ``self``, plus the keyword-only ``blocking`` flag."""
    kind = inspect.Parameter
    blocking = kind("blocking", kind.KEYWORD_ONLY, default=True, annotation="bool")
    try:
        # Drop self, and the tracing parameter that ray.remote() injects into the class's methods.
        params = list(inspect.signature(method).parameters.values())[1:]
        params = [p for p in params if p.name != "_ray_trace_ctx"]
        # **kwargs must stay last; blocking goes right before it (or at the end).
        at = len(params) - 1 if params and params[-1].kind is kind.VAR_KEYWORD else len(params)
        return inspect.Signature([*params[:at], blocking, *params[at:]])
    except (TypeError, ValueError):  # no signature, or the method has its own `blocking` parameter
        varargs, varkw = kind("args", kind.VAR_POSITIONAL), kind("kwargs", kind.VAR_KEYWORD)
        return inspect.Signature([varargs, blocking, varkw])


def wait_all(*futures: ClusterFuture) -> list[Any]:
    """Wait for several clusters' calls that run at the same time (e.g. setup of every role)."""
    return [f.get() for f in futures]


def kill_actors(workers: Sequence[Any]) -> None:
    """End the actors without asking them anything, and wait (up to 10 s) until each is gone."""
    for worker in workers:
        ray.kill(worker)
    # ray.kill only requests the end; wait until each actor is really gone so the caller can count on
    # it (its resources free, later calls failing) once this returns.
    deadline = time.monotonic() + 10.0
    for worker in workers:
        while time.monotonic() < deadline:
            try:
                ray.get(worker.ping.remote(), timeout=1.0)
            except (RayActorError, GetTimeoutError):
                break
            time.sleep(0.05)


def wait_any(futures: Sequence[ClusterFuture], timeout_s: float) -> list[ClusterFuture]:
    """Wait up to ``timeout_s`` until at least one of ``futures`` is ready (every rank it called has
    answered, or failed), and return the ready ones in the given order; their ``get()`` then does not
    block (and raises for a failed rank). [] on timeout, or at once for no futures.

    This is how a driver thread serves many workers at once (one ``collect_finished`` in flight per
    rollout worker, acting on whichever answers first) without a thread per call. While it waits,
    the pending calls' ranks are watched as ``wait_for_ranks`` watches them.

    Raises:
        WorkerTimeoutError: a pending future is past its ``deadline``; names its role, the first rank
            that has not answered and the method.
        WorkerUnresponsiveError: a pending rank stopped answering heartbeats.
    """
    futures = list(futures)
    if not futures:
        return []
    until = time.monotonic() + timeout_s
    while True:
        refs = list(dict.fromkeys(ref for future in futures for ref in future.refs))  # ray.wait: unique
        done, not_done = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        ready = [f for f in futures if all(ref in done_set for ref in f.refs)]
        if ready:
            return ready
        _watch_pending(futures, done_set)
        if time.monotonic() >= until:
            return []
        # Only refs not done yet: a future with some ranks answered must not make this return at once.
        ray.wait(not_done, num_returns=1, timeout=max(_next_wake(futures, until) - time.monotonic(), 0))


def _watch_pending(futures: Sequence[ClusterFuture], done: set[ray.ObjectRef]) -> None:
    """Raise for a future past its deadline, and poll the heartbeats of the ranks not answered yet."""
    now = time.monotonic()
    for future in futures:
        pending = [rank for ref, rank in zip(future.refs, future.ranks) if ref not in done]
        if now >= future.deadline:
            raise WorkerTimeoutError(
                future.role,
                pending[0],
                future.method,
                f"no answer after {future.timeout_s:g} s from rank(s) {pending} "
                "(raise ray.call_timeout_s, or the call's timeout_s, if this work is legitimately slow)",
            )
        if future.watch is not None:
            future.watch.poll((future.role, rank) for rank in pending)


def _next_wake(futures: Sequence[ClusterFuture], until: float) -> float:
    """When ``wait_any`` must look again: its own end, the first deadline, or the next liveness poll."""
    wake = min(until, *(future.deadline for future in futures))
    polls = [f.watch.poll_every_s for f in futures if f.watch is not None and f.watch.poll_every_s]
    if polls:
        wake = min(wake, time.monotonic() + min(polls))
    return wake


def _only(results: list[Any]) -> Any:
    """The result of a call on one rank (``call_rank``), not a list of one."""
    (result,) = results
    return result
