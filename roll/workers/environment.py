"""Environment worker: one process hosting many environment instances (an ``EnvPool``), reset and
stepped in batches, so a Ray call carries the steps of many episodes. The episode scheduler calls one
rank at a time (``Cluster.call_rank``) with the episodes it placed there.

Calls run concurrently (``CALLS`` at once): the scheduler sends the steps of whichever turns came back
together, in calls of their own, and a call lasts as long as its slowest env. Run one at a time, a call
would also wait for every call sent before it, so one slow env would hold up every episode on its
worker, enough to make the episode scheduler slower than a lockstep loop (``benchmarks/agentic.py``,
docs/agentic.md). The pool is safe across calls: they carry distinct episodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register
from roll.envs.pool import EnvPool, EnvResult


@dataclass
class EnvSpec:
    """What an environment worker hosts: the registered env, its options, the per-call timeout."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    step_timeout_s: float = 30.0


class EnvWorker(Worker):
    """``config`` is an EnvSpec. Failures of an env (a raise, a hang) come back in the results (see
    ``roll.envs.pool``); only a lost worker process is a ``WorkerError``."""

    pool: EnvPool
    # Calls served at once, and the pool's threads: envs that wait (a tool, a service) wait together.
    CALLS = 16
    THREADS = 64
    concurrency_groups = {"env_calls": CALLS}

    @register(Dispatch.ONE_TO_ALL)
    def setup(self, **_: object) -> None:
        import roll.envs  # noqa: F401  (registers the built-in environments)

        spec: EnvSpec = self.config
        self.pool = EnvPool(spec.name, spec.options, spec.step_timeout_s, threads=self.THREADS)

    @ray.method(concurrency_group="env_calls")
    def reset(self, requests: list[tuple[str, int]]) -> list[EnvResult]:
        """Start an episode per ``(episode_id, seed)``."""
        return self.pool.reset(requests)

    @ray.method(concurrency_group="env_calls")
    def step(self, actions: list[tuple[str, str]]) -> list[EnvResult]:
        """Play one turn per ``(episode_id, action_text)``."""
        return self.pool.step(actions)

    @ray.method(concurrency_group="env_calls")
    def close(self, episode_ids: list[str]) -> None:
        self.pool.close(episode_ids)

    def counters(self) -> dict[str, int]:
        return dict(self.pool.counters)

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown()
