"""The environment pool: many episodes per call, and failures (an env that raises or hangs) retried once on
a fresh instance with the episode replayed, then reported, never raised. Hangs are endless (an event
never set until the test ends), so the outcome does not depend on timing. Where calls that hang and calls
that must finish meet, a pool that times out exactly the hung calls (``HangAwarePool``) decides, so no
call that must finish has to do so within a short timeout."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from roll.envs import ENVIRONMENTS
from roll.envs.base import TextEnv
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.envs.pool import ERROR, OK, TIMEOUT, EnvPool

RELEASE = threading.Event()  # set at the end: hung env threads then finish
# A step timeout far above any call's need, even on a loaded machine.
ROOMY_S = 120.0
_HUNG: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # env calls' threads blocked in hang()


def hang(release: threading.Event) -> None:
    """Block the env call that runs this until ``release`` is set, and let a ``HangAwarePool`` time the
    call out at once."""
    _HUNG.add(threading.current_thread())
    release.wait()


class HangAwarePool(EnvPool):
    """An EnvPool whose calls time out exactly when their env hangs (``hang``), at once, while every other
    call gets up to ``step_timeout_s`` (give it a roomy one) to finish: which calls time out never depends
    on how long a call takes on a loaded machine."""

    def _wait(self, thread: threading.Thread, done: threading.Event) -> bool:
        give_up = time.monotonic() + self.step_timeout_s
        while not done.wait(0.001):
            if thread in _HUNG or time.monotonic() >= give_up:
                return False
        return True


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
            hang(RELEASE)
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
    pool = HangAwarePool("faulty", step_timeout_s=ROOMY_S)
    pool.reset([("a", 0)])
    pool.step([("a", "1")])
    result = pool.step([("a", "4")])[0]
    assert (result.status, result.observation, result.retried) == (OK, "5", True)
    Faulty.plan[(0, 1)] = ("hang", 3)  # the instance that took over hangs at its next step ...
    Faulty.plan[(0, 2)] = ("hang", 0)  # ... and the one after it at its reset
    failed = pool.step([("a", "1")])[0]
    assert failed.status == TIMEOUT and failed.error == f"timed out after {ROOMY_S} s"
    assert pool.counters["timeouts"] == 1 and pool.live == 0
    pool.shutdown()


def test_a_reset_that_hangs_on_both_tries_times_out_after_the_step_timeout(faulty) -> None:
    """The pool's own clock: every call of this episode hangs, so none has to finish in time, and each
    waits out the timeout, however busy the machine."""
    Faulty.plan = {(0, 0): ("hang", 0), (0, 1): ("hang", 0)}
    pool = EnvPool("faulty", step_timeout_s=0.2)
    started = time.monotonic()
    (result,) = pool.reset([("a", 0)])
    assert time.monotonic() - started >= 2 * 0.2
    assert (result.status, result.retried, result.error) == (TIMEOUT, True, "timed out after 0.2 s")
    assert pool.counters["retries"] == 1 and pool.counters["timeouts"] == 1 and pool.live == 0
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


def test_a_close_that_overtakes_its_reset_leaves_no_env_open() -> None:
    """A scheduler shutting down closes episodes whose reset is still out, and the worker runs calls
    concurrently, so the close may run first: the reset then closes its instance instead of keeping it.
    Other episodes, and the same id's later reset, are unaffected."""
    from roll.envs.pool import CLOSED_BEFORE_RESET, ERROR, EnvPool

    pool = EnvPool("frozen_lake", {"size": 4})
    pool.close(["early"])
    first = pool.reset([("early", 1), ("other", 2)])
    assert first[0].status == ERROR and first[0].error == CLOSED_BEFORE_RESET and not first[0].retried
    assert first[1].status == "ok"
    assert pool.live == 1 and pool.counters["errors"] == 0 and pool.counters["retries"] == 0
    again = pool.reset([("early", 3)])  # remembered once only
    assert again[0].status == "ok" and pool.live == 2
    pool.shutdown()
