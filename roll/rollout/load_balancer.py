"""Route generation requests to data-parallel rollout workers by in-flight count."""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["LoadBalancer"]


class LoadBalancer:
    """Least-loaded routing of requests to ``num_workers`` workers.

    The rollout scheduler places whole groups (the samples of one prompt stay on one worker, where an
    engine with prefix caching computes the prompt once): ``place_groups`` says where the next groups
    go, ``assign_to`` records each request sent, ``finish`` when its result (or abort) comes back,
    ``worker_of`` routes an abort to the worker that holds the request. Single requests take
    ``assign`` (least-loaded worker). Counting
    requests rather than tokens keeps it independent of the engine; a worker stuck on long responses
    still collects no new work while it has more in flight than the others.

    Safe to call from several threads.
    """

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"a load balancer needs at least one worker, got num_workers={num_workers}")
        self._lock = threading.Lock()
        self._counts = [0] * num_workers
        self._worker_of: dict[str, int] = {}

    @property
    def num_workers(self) -> int:
        return len(self._counts)

    def assign(self, request_id: str) -> int:
        """Record ``request_id`` as in flight on the least-loaded worker (ties: lowest index) and return it.

        Raises:
            ValueError: ``request_id`` is already in flight.
        """
        with self._lock:
            if request_id in self._worker_of:
                raise ValueError(
                    f"request {request_id!r} is already in flight on worker {self._worker_of[request_id]}"
                )
            # min() returns the first minimum, which is the lowest index among ties.
            worker = min(range(len(self._counts)), key=self._counts.__getitem__)
            self._counts[worker] += 1
            self._worker_of[request_id] = worker
            return worker

    def assign_to(self, request_id: str, worker: int) -> None:
        """Record ``request_id`` as in flight on ``worker`` (a placement ``place_groups`` chose).

        Raises:
            ValueError: ``request_id`` is already in flight, or ``worker`` is out of range.
        """
        with self._lock:
            if not 0 <= worker < len(self._counts):
                raise ValueError(f"worker {worker} is out of range for {len(self._counts)} workers")
            if request_id in self._worker_of:
                raise ValueError(
                    f"request {request_id!r} is already in flight on worker {self._worker_of[request_id]}"
                )
            self._counts[worker] += 1
            self._worker_of[request_id] = worker

    def place_groups(self, sizes: Sequence[int], cap: int | None = None) -> list[int]:
        """Workers for the leading groups of ``sizes`` (requests per group) that fit now; records nothing.

        Each group goes whole to one worker. A group fits a worker whose in-flight count stays within
        ``cap`` with it (None: no cap), or an idle worker (a group larger than the cap still runs; the
        engine queues the excess). Groups are placed in order and placement stops at the first group
        that fits nowhere, so later prompts never overtake earlier ones. The number of groups each
        worker gets is that of least-loaded placement (ties: lowest index); the groups are then handed
        out in contiguous runs in worker order, so that with equal loads the split is the one batch
        generation makes (worker 0 takes the first share): sampling repeats that of a batch run.

        Returns:
            One worker index per placed group: ``len(result) <= len(sizes)``.
        """
        loads = self.in_flight()
        counts = [0] * len(loads)
        for size in sizes:
            fits = [w for w, load in enumerate(loads) if load == 0 or cap is None or load + size <= cap]
            if not fits:
                break
            worker = min(fits, key=loads.__getitem__)
            loads[worker] += size
            counts[worker] += 1
        return [worker for worker, count in enumerate(counts) for _ in range(count)]

    def finish(self, request_id: str) -> int:
        """Record ``request_id`` as done and return the worker it ran on.

        Raises:
            KeyError: ``request_id`` is not in flight (never assigned, or already finished).
        """
        with self._lock:
            worker = self._worker_of.pop(request_id, None)
            if worker is None:
                raise KeyError(f"request {request_id!r} is not in flight: never assigned or already finished")
            self._counts[worker] -= 1
            return worker

    def worker_of(self, request_id: str) -> int | None:
        """The worker ``request_id`` is in flight on, or None when it is not in flight."""
        with self._lock:
            return self._worker_of.get(request_id)

    def in_flight(self) -> list[int]:
        """The number of in-flight requests per worker, by worker index."""
        with self._lock:
            return list(self._counts)
