"""Single generation requests over the data-parallel rollout workers: each request goes to the worker with
the fewest requests in flight, and is awaited or aborted by its id there. The rollout scheduler builds on
this; batch generation splits a batch across the workers instead (``rollout.generate``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import ray

from roll.distributed.cluster import Cluster, wait_for_ranks
from roll.distributed.load_balancer import LoadBalancer
from roll.strategies.infer import GenerateRequest, GenerateResult
from roll.strategies.sampling import SamplingParams


class RolloutRouter:
    """Routes requests to the workers of a rollout ``Cluster`` (``RolloutWorker`` serves requests and
    aborts in their own threads, so an abort reaches a worker while it generates)."""

    def __init__(self, rollout: Cluster, timeout_s: float | None = None):
        self.rollout = rollout
        self.timeout_s = rollout.timeout_s if timeout_s is None else timeout_s
        self.balancer = LoadBalancer(rollout.world_size)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue one request on the least-loaded worker; returns its id."""
        request = GenerateRequest(request_id or uuid.uuid4().hex, tuple(prompt_ids), params)
        request_id = request.request_id
        rank = self.balancer.assign(request_id)
        try:
            self._call(rank, "submit", request)
        except Exception:
            self.balancer.finish(request_id)
            raise
        return request_id

    def result(self, request_id: str, timeout_s: float | None = None) -> GenerateResult:
        """Wait for a request's result (tokens, logprobs, finish reason); it then leaves the balancer."""
        rank = self._rank_of(request_id)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self._call(rank, "await_result", request_id, timeout, timeout_s=timeout + 5.0)
        finally:
            self.balancer.finish(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request (its result then says ``abort``); False if already done."""
        return self._call(self._rank_of(request_id), "abort", request_id)

    def in_flight(self) -> list[int]:
        """Requests submitted and not yet collected, per worker."""
        return self.balancer.in_flight()

    def _rank_of(self, request_id: str) -> int:
        rank = self.balancer.worker_of(request_id)
        if rank is None:
            raise KeyError(f"unknown request id {request_id!r} (never submitted, or its result was taken)")
        return rank

    def _call(self, rank: int, method: str, *args: object, timeout_s: float | None = None) -> object:
        worker = self.rollout.workers[rank]
        ref: ray.ObjectRef = getattr(worker, method).remote(*args)
        # Reuse the cluster's error reporting: role, rank, method and the remote traceback.
        watch = self.rollout.watch(method, [rank])
        (result,) = wait_for_ranks(
            [ref], self.rollout.role, method, timeout_s or self.timeout_s, [rank], watch
        )
        return result
