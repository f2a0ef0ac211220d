"""Requests to data-parallel rollout workers, by rank: send a group's requests, abort, collect results.

The scheduler decides where each group goes (``LoadBalancer.place_groups``); the router makes the
calls through the Cluster's per-rank call (``Cluster.call_rank``), so errors and timeouts name the
role, rank and method. Each worker always has one ``collect_finished`` call outstanding, which returns
as soon as any of its requests ends (and every other that ended with it): results stream back one Ray
round trip after they finish, whatever the order they were sent in.
"""

from __future__ import annotations

from collections.abc import Sequence

from roll.distributed.cluster import Cluster, ClusterFuture
from roll.strategies.requests import GenerateRequest, GenerateResult

__all__ = ["RolloutRouter"]


class RolloutRouter:
    """Per-rank request calls to a rollout ``Cluster`` of ``RolloutWorker`` (its ``submit_many``,
    ``abort_many`` and ``collect_finished`` run in a thread group of their own, beside generation).

    Args:
        rollout: the rollout workers.
        collect_wait_s: how long one ``collect_finished`` call waits on the worker when nothing ends;
            it is re-issued at once, so this only bounds how long an idle call stays open.
    """

    def __init__(self, rollout: Cluster, collect_wait_s: float = 1.0):
        self.rollout = rollout
        self.num_workers = rollout.world_size
        self.collect_wait_s = collect_wait_s
        self._collects: dict[ClusterFuture, int] = {}
        self._calls: list[ClusterFuture] = []  # submits and aborts, checked for errors as they land

    def send(self, worker: int, requests: Sequence[GenerateRequest]) -> None:
        """Queue ``requests`` on ``worker`` in one call (a group's samples are admitted together)."""
        self._calls.append(self.rollout.call_rank(worker, "submit_many", list(requests), blocking=False))

    def abort(self, worker: int, request_ids: Sequence[str]) -> None:
        self._calls.append(self.rollout.call_rank(worker, "abort_many", list(request_ids), blocking=False))

    def release_prefixes(self, worker: int, cache_keys: Sequence[str]) -> None:
        """Free the KV ``worker`` keeps for ``cache_keys`` (ended episodes); returns at once."""
        self._calls.append(
            self.rollout.call_rank(worker, "release_prefixes", list(cache_keys), blocking=False)
        )

    def prefix_stats(self) -> list[dict[str, int]]:
        """Each worker's prefix-reuse counters (``RolloutWorker.prefix_stats``), by rank; blocking."""
        return [self.rollout.call_rank(worker, "prefix_stats") for worker in range(self.num_workers)]

    def outstanding(self) -> list[ClusterFuture]:
        """Every call in flight, with a ``collect_finished`` open on each worker (opened if missing)."""
        open_on = set(self._collects.values())
        for worker in range(self.num_workers):
            if worker not in open_on:
                future = self.rollout.call_rank(
                    worker,
                    "collect_finished",
                    self.collect_wait_s,
                    blocking=False,
                    timeout_s=self.collect_wait_s + self.rollout.timeout_s,
                )
                self._collects[future] = worker
        return [*self._collects, *self._calls]

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the calls in flight (a ``collect_finished`` returns within
        ``collect_wait_s``) and drop their results and errors, opening no new ones: a collect left open
        would take the results of whoever sends to these workers next."""
        self.rollout.discard([*self._collects, *self._calls], timeout_s)
        self._collects.clear()
        self._calls.clear()

    def take(self, future: ClusterFuture) -> list[GenerateResult]:
        """The results of a ready call from ``outstanding`` (none for a submit or an abort, whose errors
        are raised here)."""
        if future in self._collects:
            del self._collects[future]
            return future.get()
        self._calls.remove(future)
        future.get()
        return []
