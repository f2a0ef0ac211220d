"""Many environment instances in one process, reset and stepped in batches: an environment worker hosts
one pool, so a Ray call carries the steps of many episodes and no hop is paid per env step. Pure: no
Ray, no tokens.

Failures never escape a call. Each reset or step runs with a timeout (``step_timeout_s``). An env that
raises or hangs is retried once on a fresh instance: reset with the episode's seed, its earlier actions
replayed (a seed fixes an episode, so the replay lands in the same state), then the failed call again.
If that fails too, the episode's result says ``error`` or ``timeout`` and its owner drops it (with its
group). A hung call's thread cannot be killed; it is abandoned and its instance never used again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

from roll.envs.base import TextEnv, make_env

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
# A step's env failed and, before its retry, its owner closed the episode (another call's close).
CLOSED_WHILE_STEPPING = "the episode was closed while it stepped"
# Its owner closed the episode before its reset ran (a scheduler shutting down with resets still out).
CLOSED_BEFORE_RESET = "the episode was closed before its reset ran"
# How many such closes are remembered (a close can also come for an episode whose reset failed, which
# no reset will ever take off the list).
_REMEMBERED_EARLY_CLOSES = 4096


@dataclass
class EnvResult:
    """What one reset or step of one episode gave."""

    episode_id: str
    status: str = OK  # ok, error (raised twice) or timeout (hung twice)
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    retried: bool = False  # the first try failed and a fresh instance took over
    error: str | None = None  # the last failure, "ExceptionType: message" or "timed out after N s"


@dataclass
class _Episode:
    seed: int
    env: TextEnv
    actions: list[str] = field(default_factory=list)


class EnvPool:
    """Environment ``name`` with ``options``, one instance per live episode.

    Args:
        name: the registered environment.
        options: its options.
        step_timeout_s: how long one reset or step may take (replays of a retry get as long each).
        threads: how many calls run at once.
    """

    def __init__(
        self, name: str, options: dict[str, Any] | None = None, step_timeout_s: float = 30.0, threads: int = 8
    ):
        self.name, self.options, self.step_timeout_s = name, dict(options or {}), step_timeout_s
        self._episodes: dict[str, _Episode] = {}
        # Calls run concurrently, so a close can overtake its episode's reset; that reset then closes its
        # instance at once instead of keeping it until the worker ends.
        self._closed_before_reset: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Runs each episode's call (which waits on its own daemon thread for the env, see _call).
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"env-{name}")
        self.counters = {"resets": 0, "steps": 0, "retries": 0, "errors": 0, "timeouts": 0}

    def reset(self, requests: list[tuple[str, int]]) -> list[EnvResult]:
        """Start an episode per ``(episode_id, seed)``; every reset runs at once."""
        futures = [self._executor.submit(self._reset_one, episode_id, seed) for episode_id, seed in requests]
        return [f.result() for f in futures]

    def step(self, actions: list[tuple[str, str]]) -> list[EnvResult]:
        """Play one turn per ``(episode_id, action_text)``; every step runs at once."""
        futures = [self._executor.submit(self._step_one, episode_id, text) for episode_id, text in actions]
        return [f.result() for f in futures]

    def close(self, episode_ids: list[str]) -> None:
        """Forget finished or dropped episodes and close their instances."""
        for episode_id in episode_ids:
            with self._lock:
                episode = self._episodes.pop(episode_id, None)
                if episode is None:
                    self._closed_before_reset[episode_id] = None
                    if len(self._closed_before_reset) > _REMEMBERED_EARLY_CLOSES:
                        self._closed_before_reset.popitem(last=False)
            if episode is not None:
                _quietly(episode.env.close)

    def shutdown(self) -> None:
        self.close(list(self._episodes))
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    @property
    def live(self) -> int:
        return len(self._episodes)

    # ----- one episode's calls, on a pool thread ----------------------------------------------------------

    def _reset_one(self, episode_id: str, seed: int) -> EnvResult:
        self._count("resets")
        result, failure = self._fresh(episode_id, seed, [])
        if failure is None:
            return result
        if failure[1] == CLOSED_BEFORE_RESET:
            return EnvResult(episode_id, ERROR, error=CLOSED_BEFORE_RESET)  # no env failed: no retry
        self._count("retries")
        result, failure = self._fresh(episode_id, seed, [])
        return self._failed(episode_id, failure) if failure else _retried(result)

    def _step_one(self, episode_id: str, text: str) -> EnvResult:
        self._count("steps")
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise KeyError(f"no live episode {episode_id!r} in the {self.name} pool (reset it first)")
        result, failure = self._call(episode_id, episode.env.step, text)
        if failure is None:
            episode.actions.append(text)
            return result
        self._count("retries")
        _, failure = self._fresh(episode_id, episode.seed, episode.actions, replacing=True)
        if failure is None:
            with self._lock:
                episode = self._episodes.get(episode_id)
            if episode is None:  # closed meanwhile
                return EnvResult(episode_id, ERROR, retried=True, error=CLOSED_WHILE_STEPPING)
            result, failure = self._call(episode_id, episode.env.step, text)
        if failure is not None:
            return self._failed(episode_id, failure)
        episode.actions.append(text)
        return _retried(result)

    def _fresh(
        self, episode_id: str, seed: int, replay: list[str], replacing: bool = False
    ) -> tuple[EnvResult, tuple[str, str] | None]:
        """A new instance for the episode, reset with ``seed`` and ``replay`` played again. ``replacing``:
        the instance of a live episode failed; if the episode was closed meanwhile (calls run
        concurrently: its group ended while it stepped), nobody wants a new one."""
        try:
            env = make_env(self.name, self.options)
        except Exception as error:  # noqa: BLE001 - reported in the result, never raised
            return EnvResult(episode_id), (ERROR, f"{type(error).__name__}: {error}")
        with self._lock:
            old = self._episodes.get(episode_id)
            if replacing:
                closed = CLOSED_WHILE_STEPPING if old is None else None
            else:
                closed = CLOSED_BEFORE_RESET if episode_id in self._closed_before_reset else None
                self._closed_before_reset.pop(episode_id, None)
            if not closed:
                self._episodes[episode_id] = _Episode(seed, env, list(replay))
        if closed:
            _close_in_background(env)
            return EnvResult(episode_id), (ERROR, closed)
        if old is not None:
            _close_in_background(old.env)
        result, failure = self._call(episode_id, env.reset, seed)
        for text in replay:
            if failure is not None:
                break
            result, failure = self._call(episode_id, env.step, text)
        return result, failure

    def _call(self, episode_id: str, method: Any, argument: Any) -> tuple[EnvResult, tuple[str, str] | None]:
        """``method(argument)`` on a thread of its own, within ``step_timeout_s``. A daemon thread: one
        that hangs is abandoned and cannot keep the process alive at exit (pool threads would)."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["out"] = method(argument)
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                box["error"] = error
            finally:
                done.set()

        thread = threading.Thread(target=run, name=f"env-{self.name}-{episode_id}", daemon=True)
        thread.start()
        if not self._wait(thread, done):
            return EnvResult(episode_id), (TIMEOUT, f"timed out after {self.step_timeout_s} s")
        if "error" in box:
            error = box["error"]
            return EnvResult(episode_id), (ERROR, f"{type(error).__name__}: {error}")
        out = box["out"]
        if len(out) == 2:  # reset: (observation, info)
            return EnvResult(episode_id, observation=out[0], info=dict(out[1])), None
        observation, reward, terminated, truncated, info = out
        return EnvResult(
            episode_id, OK, observation, float(reward), bool(terminated), bool(truncated), dict(info)
        ), None

    def _wait(self, thread: threading.Thread, done: threading.Event) -> bool:
        """Whether the env call running on ``thread`` ended (``done``) within ``step_timeout_s``. Tests
        override it to time out the calls of envs they made hang at once, and give the others all the
        time they need."""
        return done.wait(self.step_timeout_s)

    def _failed(self, episode_id: str, failure: tuple[str, str]) -> EnvResult:
        status, message = failure
        self._count("errors" if status == ERROR else "timeouts")
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            _close_in_background(episode.env)
        return EnvResult(episode_id, status, retried=True, error=message)


def _retried(result: EnvResult) -> EnvResult:
    result.retried = True
    return result


def _close_in_background(env: TextEnv) -> None:
    """Close a failed instance without waiting: one that hung may never return."""
    threading.Thread(target=_quietly, args=(env.close,), daemon=True).start()


def _quietly(close: Any) -> None:
    try:
        close()
    except Exception:  # noqa: BLE001 - closing a failed env must not fail its caller
        pass
