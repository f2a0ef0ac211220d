"""How the episode scheduler reaches many episodes' environments: in this process (``LocalEnvs``) or on
environment workers (``RayEnvs``). Resets wait; steps are sent and their results polled, so a slow env
holds up only the episodes stepped in the same call."""

from __future__ import annotations

import collections
from typing import Any, Protocol

from roll.envs.pool import EnvPool, EnvResult

__all__ = ["EnvClient", "LocalEnvs", "RayEnvs"]


class EnvClient(Protocol):
    """Many episodes' environments (``roll.envs.pool.EnvPool`` semantics). Resets wait; steps are sent
    and their results polled, so a slow env holds up only the episodes stepped in the same call."""

    def reset(self, requests: list[tuple[str, int]]) -> list[EnvResult]: ...

    def send(self, actions: list[tuple[str, str]]) -> None: ...

    def poll(self, timeout_s: float) -> list[EnvResult]:
        """Results of sent steps that have come back, waiting up to ``timeout_s`` for the first."""

    @property
    def pending(self) -> int:
        """Steps sent whose results have not been polled."""

    def close(self, episode_ids: list[str]) -> None: ...


class LocalEnvs:
    """The environments in this process (tests; an env cheaper than a Ray call): a step runs when sent."""

    def __init__(self, pool: EnvPool):
        self.pool = pool
        self._done: list[EnvResult] = []

    def reset(self, requests: list[tuple[str, int]]) -> list[EnvResult]:
        return self.pool.reset(requests)

    def send(self, actions: list[tuple[str, str]]) -> None:
        self._done += self.pool.step(actions)

    def poll(self, timeout_s: float) -> list[EnvResult]:
        done, self._done = self._done, []
        return done

    @property
    def pending(self) -> int:
        return len(self._done)

    def close(self, episode_ids: list[str]) -> None:
        self.pool.close(episode_ids)


class RayEnvs:
    """Environment workers (``roll.workers.environment.EnvWorker``): each episode lives on one rank,
    chosen at its reset (the rank with the fewest live episodes); one call per rank carries all of its
    episodes' steps, the ranks' calls run at once, and steps sent later go in calls of their own. A lost
    worker raises ``WorkerError`` naming its rank."""

    def __init__(self, cluster: Any):
        self.cluster = cluster
        self.rank_of: dict[str, int] = {}
        self.live = [0] * cluster.world_size
        self._calls: dict[Any, int] = {}  # step call in flight -> how many steps it carries

    def reset(self, requests: list[tuple[str, int]]) -> list[EnvResult]:
        for episode_id, _ in requests:
            rank = min(range(len(self.live)), key=self.live.__getitem__)
            self.rank_of[episode_id] = rank
            self.live[rank] += 1
        return [result for future, _ in self._call("reset", requests) for result in future.get()]

    def send(self, actions: list[tuple[str, str]]) -> None:
        for future, size in self._call("step", actions):
            self._calls[future] = size

    def poll(self, timeout_s: float) -> list[EnvResult]:
        from roll.distributed.cluster import wait_any

        results = []
        for future in wait_any(list(self._calls), timeout_s):
            del self._calls[future]
            results += future.get()
        return results

    @property
    def pending(self) -> int:
        return sum(self._calls.values())

    def close(self, episode_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = collections.defaultdict(list)
        for episode_id in episode_ids:
            rank = self.rank_of.pop(episode_id, None)
            if rank is not None:
                self.live[rank] -= 1
                by_rank[rank].append(episode_id)
        futures = [self.cluster.call_rank(r, "close", ids, blocking=False) for r, ids in by_rank.items()]
        for future in futures:
            future.get()

    def _call(self, method: str, items: list[tuple[str, Any]]) -> list[tuple[Any, int]]:
        """One non-blocking call per rank with its episodes' items: (future, how many items)."""
        by_rank: dict[int, list[tuple[str, Any]]] = collections.defaultdict(list)
        for item in items:
            by_rank[self.rank_of[item[0]]].append(item)
        return [
            (self.cluster.call_rank(r, method, part, blocking=False), len(part))
            for r, part in by_rank.items()
        ]
