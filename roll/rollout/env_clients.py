"""How the episode scheduler reaches many episodes' environments: in this process (``LocalEnvs``) or on
environment workers (``RayEnvs``). Nothing waits: resets and steps are sent and their results polled,
closes are sent and forgotten, so a slow env holds up only the episodes in its own call, and an
environment worker that stops answering holds up nobody (its calls fail at the liveness bound, in
``poll``)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from roll.envs.pool import EnvPool, EnvResult

__all__ = ["EnvCalls", "EnvClient", "LocalEnvs", "RayEnvs"]


class EnvClient(Protocol):
    """Many episodes' environments (``roll.envs.pool.EnvPool`` semantics). Nothing waits: resets and
    steps are sent and their results polled (one result per episode, a reset's or a step's: an episode
    has one call out at a time), closes are sent only."""

    def send_resets(self, requests: list[tuple[str, int]]) -> None:
        """Start an episode per ``(episode_id, seed)``; the results come back through ``poll``."""

    def send(self, actions: list[tuple[str, str]]) -> None:
        """Step an episode per ``(episode_id, action_text)``; the results come back through ``poll``."""

    def poll(self, timeout_s: float) -> list[EnvResult]:
        """Results of sent resets and steps that have come back, waiting up to ``timeout_s`` for the first."""

    @property
    def pending(self) -> int:
        """Resets and steps sent whose results have not been polled."""

    def close(self, episode_ids: list[str]) -> None:
        """Forget the episodes and close their envs, without waiting. An episode with a reset or step out
        must not be closed before its result is polled: the close could overtake that call."""


class EnvCalls:
    """The calls an episode scheduler has out on an ``EnvClient``: which episodes wait for a reset or a
    step (and since when), and closes held back until such a call comes back, since a close sent
    meanwhile could overtake it on the env worker (and a reset would then start an env nobody closes)."""

    def __init__(self, envs: EnvClient, clock: Callable[[], float]):
        self.envs, self.clock = envs, clock
        self._resetting: set[str] = set()
        self._stepping: dict[str, float] = {}  # episode id -> when its step was sent
        self._held: set[str] = set()  # closed while a call was out: closed when it comes back

    def reset(self, requests: list[tuple[str, int]]) -> None:
        self._resetting.update(eid for eid, _ in requests)
        self.envs.send_resets(requests)

    def step(self, actions: list[tuple[str, str]]) -> None:
        now = self.clock()
        self._stepping.update((eid, now) for eid, _ in actions)
        self.envs.send(actions)

    def waiting(self, episode_id: str) -> bool:
        """Whether the episode waits for its env's answer to a reset or a step."""
        return episode_id in self._resetting or episode_id in self._stepping

    def answered(self, results: list[EnvResult]) -> list[tuple[EnvResult, float | None]]:
        """The results still wanted, each with None for a reset or the seconds since its step was sent.
        Those of episodes closed meanwhile are left out, and their envs closed now."""
        wanted, closing = [], []
        now = self.clock()
        for result in results:
            eid = result.episode_id
            if eid in self._held:
                self._held.discard(eid)
                closing.append(eid)
            elif eid in self._resetting:
                self._resetting.discard(eid)
                wanted.append((result, None))
            elif eid in self._stepping:
                wanted.append((result, now - self._stepping.pop(eid)))
        if closing:
            self.envs.close(closing)
        return wanted

    def close(self, episode_ids: Iterable[str]) -> None:
        """Close the episodes' envs: now, or for one with a call out, when that call comes back."""
        episode_ids = list(episode_ids)
        out = {eid for eid in episode_ids if self.waiting(eid)}
        self._held |= out
        self.envs.close([eid for eid in episode_ids if eid not in out])
        for eid in out:
            self._resetting.discard(eid)
            self._stepping.pop(eid, None)

    def close_held(self) -> None:
        """Close the envs held back too: no poll will take their calls' results now. A close that overtakes
        its episode's reset on the worker makes that reset close its env (``EnvPool``)."""
        if self._held:
            self.envs.close(sorted(self._held))
            self._held.clear()


class LocalEnvs:
    """The environments in this process (tests; an env cheaper than a Ray call): a call runs when sent."""

    def __init__(self, pool: EnvPool):
        self.pool = pool
        self._done: list[EnvResult] = []

    def send_resets(self, requests: list[tuple[str, int]]) -> None:
        self._done += self.pool.reset(requests)

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
    episodes' resets or steps, the ranks' calls run at once, and those sent later go in calls of their
    own. A lost or frozen worker raises ``WorkerError`` naming its rank from ``poll`` (the liveness
    bound tells a frozen one); no method waits on a worker."""

    def __init__(self, cluster: Any):
        self.cluster = cluster
        self.rank_of: dict[str, int] = {}
        self.live = [0] * cluster.world_size
        self._calls: dict[Any, int] = {}  # reset or step call in flight -> how many results it carries
        # Close calls in flight: their results are nothing, but polling them tells of a worker lost (or
        # frozen) while only closes were out, and they are never waited for.
        self._closes: list[Any] = []

    def send_resets(self, requests: list[tuple[str, int]]) -> None:
        for episode_id, _ in requests:
            rank = min(range(len(self.live)), key=self.live.__getitem__)
            self.rank_of[episode_id] = rank
            self.live[rank] += 1
        for future, size in self._call("reset", requests):
            self._calls[future] = size

    def send(self, actions: list[tuple[str, str]]) -> None:
        for future, size in self._call("step", actions):
            self._calls[future] = size

    def poll(self, timeout_s: float) -> list[EnvResult]:
        from roll.distributed.cluster import wait_any

        results = []
        for future in wait_any([*self._calls, *self._closes], timeout_s):
            if future in self._calls:
                del self._calls[future]
                results += future.get()
            else:
                self._closes.remove(future)
                future.get()  # raises for a lost worker
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
        self._closes += [
            self.cluster.call_rank(r, "close", ids, blocking=False) for r, ids in by_rank.items()
        ]

    def _call(self, method: str, items: list[tuple[str, Any]]) -> list[tuple[Any, int]]:
        """One non-blocking call per rank with its episodes' items: (future, how many items)."""
        by_rank: dict[int, list[tuple[str, Any]]] = collections.defaultdict(list)
        for item in items:
            by_rank[self.rank_of[item[0]]].append(item)
        return [
            (self.cluster.call_rank(r, method, part, blocking=False), len(part))
            for r, part in by_rank.items()
        ]
