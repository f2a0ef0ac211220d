"""Route single generation requests to data-parallel rollout workers by in-flight count."""

from __future__ import annotations

import threading

__all__ = ["LoadBalancer"]


class LoadBalancer:
    """Least-loaded routing of requests to ``num_workers`` workers.

    The rollout scheduler uses it to send single requests (``InferenceEngine.submit``) to the
    data-parallel rollout workers: ``assign`` when a request is sent, ``finish`` when its result (or
    abort) comes back, ``worker_of`` to route an abort to the worker that holds the request. Counting
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
