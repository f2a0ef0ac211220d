"""The environment pool: many episodes per call, and failures (an env that raises or hangs) retried once on
a fresh instance with the episode replayed, then reported, never raised. Hangs are endless (an event
never set until the test ends), so the outcome does not depend on timing; the timeout only bounds how
long the test waits."""

from __future__ import annotations

import threading

import pytest

from roll.envs import ENVIRONMENTS
from roll.envs.base import TextEnv
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.envs.pool import ERROR, OK, TIMEOUT, EnvPool

RELEASE = threading.Event()  # set at the end: hung env threads then finish


class Faulty(TextEnv):
    """A counter env. ``plan[(seed, k)] = (how, at)``: the k-th instance (0-based) that resets with
    ``seed`` raises or hangs at its ``at``-th call (0: the reset). Keyed by seed, not by creation order,
    so episodes reset side by side do not race for a place in the plan."""

    plan: dict[tuple[int, int], tuple[str, int]] = {}
    generations: dict[int, int] = {}
    lock = threading.Lock()

    def _maybe_fail(self) -> None:
        how, at = Faulty.plan.get(self.key, ("", -1))
        if self.calls == at:
            if how == "raise":
                raise RuntimeError(f"instance {self.key} broke")
            RELEASE.wait()
        self.calls += 1

    def reset(self, seed):
        with Faulty.lock:
            self.key = (seed, Faulty.generations.get(seed, 0))
            Faulty.generations[seed] = self.key[1] + 1
        self.count, self.calls = seed, 0
        self._maybe_fail()
        return str(self.count), {}

    def step(self, action_text):
        self._maybe_fail()
        self.count += int(action_text)
        return str(self.count), float(action_text), self.count >= 10, False, {"action_is_valid": True}


@pytest.fixture
def faulty(monkeypatch):
    monkeypatch.setattr(ENVIRONMENTS, "_entries", {**ENVIRONMENTS._entries, "faulty": Faulty})
    monkeypatch.setattr(ENVIRONMENTS, "_traits", {**ENVIRONMENTS._traits, "faulty": {}})
    Faulty.plan, Faulty.generations = {}, {}
    RELEASE.clear()
    yield
    RELEASE.set()


def test_many_episodes_per_call_match_single_envs() -> None:
    pool = EnvPool("frozen_lake", {"size": 4})
    seeds = list(range(8))
    starts = pool.reset([(f"e{s}", s) for s in seeds])
    assert [r.observation for r in starts] == [FrozenLake(size=4).reset(s)[0] for s in seeds]
    paths = {f"e{s}": shortest_path(r.observation) for s, r in zip(seeds, starts)}
    done = {}
    while len(done) < len(seeds):  # one call steps every live episode
        moves = [(e, path.pop(0)) for e, path in paths.items() if e not in done]
        for result in pool.step(moves):
            assert result.status == OK and not result.retried
            if result.terminated:
                done[result.episode_id] = result.reward
    assert set(done.values()) == {1.0}
    pool.close(list(paths))
    assert pool.live == 0
    pool.shutdown()


def test_a_step_that_raises_is_replayed_on_a_fresh_instance(faulty) -> None:
    Faulty.plan = {(0, 0): ("raise", 3)}  # the first instance breaks at its third step
    pool = EnvPool("faulty")
    assert pool.reset([("a", 0)])[0].observation == "0"
    assert [pool.step([("a", "2")])[0].observation for _ in range(2)] == ["2", "4"]
    result = pool.step([("a", "3")])[0]
    # A fresh instance replayed 2, 2 and took the 3: the episode goes on where it was.
    assert (result.status, result.observation, result.retried) == (OK, "7", True)
    assert pool.step([("a", "3")])[0].terminated
    assert pool.counters["retries"] == 1 and pool.counters["errors"] == 0
    pool.shutdown()


def test_an_env_that_fails_twice_is_reported_and_dropped(faulty) -> None:
    Faulty.plan = {(0, 0): ("raise", 1), (0, 1): ("raise", 0)}  # the step fails, then the fresh reset
    pool = EnvPool("faulty")
    pool.reset([("a", 0), ("b", 5)])
    results = pool.step([("a", "1"), ("b", "1")])
    assert (results[0].status, results[0].retried) == (ERROR, True)
    assert "RuntimeError: instance (0, 1) broke" in results[0].error
    assert results[1].status == OK and results[1].observation == "6"  # the other episode is untouched
    assert pool.live == 1 and pool.counters["errors"] == 1
    with pytest.raises(KeyError, match="no live episode 'a'"):
        pool.step([("a", "1")])
    pool.shutdown()


def test_a_hung_env_times_out_and_a_fresh_instance_takes_over(faulty) -> None:
    Faulty.plan = {(0, 0): ("hang", 2)}  # the first instance hangs at its second step
    pool = EnvPool("faulty", step_timeout_s=0.2)
    pool.reset([("a", 0)])
    pool.step([("a", "1")])
    result = pool.step([("a", "4")])[0]
    assert (result.status, result.observation, result.retried) == (OK, "5", True)
    Faulty.plan[(0, 1)] = ("hang", 3)  # the instance that took over hangs at its next step ...
    Faulty.plan[(0, 2)] = ("hang", 0)  # ... and the one after it at its reset
    failed = pool.step([("a", "1")])[0]
    assert failed.status == TIMEOUT and failed.error == "timed out after 0.2 s"
    assert pool.counters["timeouts"] == 1 and pool.live == 0
    pool.shutdown()


def test_an_episode_closed_while_its_failing_step_runs_is_not_brought_back() -> None:
    """Environment workers serve calls concurrently: a group may close an episode whose step (in another
    call) is failing. The retry must not put a fresh instance back for an episode nobody owns."""
    import threading

    from roll.envs import ENVIRONMENTS
    from roll.envs.frozen_lake import FrozenLake
    from roll.envs.pool import CLOSED_WHILE_STEPPING, ERROR, EnvPool

    entered, release = threading.Event(), threading.Event()

    class Cracking(FrozenLake):
        def step(self, action_text):
            entered.set()
            release.wait()
            raise RuntimeError("cracked")

    ENVIRONMENTS._entries["cracking_lake"] = Cracking
    try:
        pool = EnvPool("cracking_lake", {"size": 4})
        pool.reset([("a", 1)])
        stepping = threading.Thread(target=lambda: results.extend(pool.step([("a", "L")])))
        results: list = []
        stepping.start()
        assert entered.wait(60), "the step never started"
        pool.close(["a"])  # the episode's group ended while its step runs
        release.set()
        stepping.join(60)
        assert results[0].status == ERROR and results[0].error == CLOSED_WHILE_STEPPING
        assert pool.live == 0  # no fresh instance was put back
    finally:
        release.set()
        del ENVIRONMENTS._entries["cracking_lake"]
