"""Users' agent programs, run as episodes: the ``agent:`` section's ``entrypoint``.

An agent program is a function of an OpenAI client and a task (a row of the task dataset)::

    async def run(client: openai.AsyncOpenAI, task: dict) -> float | None

or the same as a plain function taking an ``openai.OpenAI``. Each run gets a client pointed at its own session
of the endpoint (``roll.serving``; the record is ``roll.rollout.sessions``), so what the policy samples for it
is recorded as token ids. It returns its reward, or None when it posted one (``POST
/rl/sessions/<id>/reward``) or when ``agent.reward`` (a registered reward function) is to score its
transcript.

``AgentRunner`` plays the runs on one asyncio loop in a thread of the driver, at most
``agent.concurrency`` at once (the rest wait in start order), each within a wall-time bound counted from
its start, and measures how long async agents' blocking code held the loop up; a plain function runs on
a thread of its own, started with the run (asyncio's default pool has ``min(32, cores + 4)`` threads: more
runs would wait for one with their clocks running, and a hung agent would hold one for good). A thread
cannot be cancelled: past its bound its session is closed, so its next call fails and it ends.
``TaskList`` holds the tasks, the first ``held_out`` of them for evaluation only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import math
import os
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll.data.formats import read_rows
from roll.utils.plugins import import_plugins

if TYPE_CHECKING:
    from roll.config.agentic import AgentConfig

__all__ = ["AgentOutcome", "AgentRunner", "TaskList", "check_agent", "load_entrypoint"]

# How the OpenAI client of a run behaves: it retries a 429 (too much in flight) and a 5xx this often.
CLIENT_RETRIES = 5


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names, imported now: ``package.module:function`` (the working directory is
    searched first, as for ``imports``) or ``path/to/file.py:function``.

    Raises:
        ValueError: ``spec`` is neither form, or the module has no such function.
        ImportError: the module cannot be imported (naming the file and line of a broken module).
    """
    module_name, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not name.isidentifier():
        raise ValueError(
            f"entrypoint {spec!r}: write it as module:function or file.py:function (e.g. my_agent:run)"
        )
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name))
    else:
        import_plugins([module_name], search_path=os.getcwd())
        module = importlib.import_module(module_name)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"entrypoint {spec!r}: {module_name} has no function {name}")
    return function


def _import_file(path: Path) -> Any:
    import importlib.util
    import sys

    if not path.is_file():
        raise ImportError(f"{path} does not exist (relative paths start at {os.getcwd()})")
    module_name = f"roll_agent_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise ImportError(f"cannot import {path}: {type(error).__name__}: {error}") from error
    return module


def check_agent(agent: AgentConfig, held_out: int) -> list[str]:
    """What is wrong with an ``agent:`` section, each naming its key: an entrypoint that does not import,
    a task file that cannot be read or holds too few tasks, an unknown reward."""
    problems = []
    try:
        load_entrypoint(agent.entrypoint)
    except (ImportError, ValueError) as error:
        problems.append(f"agent.entrypoint: {error}")
    try:
        TaskList(agent.tasks, held_out)
    except ValueError as error:  # DatasetError is one
        problems.append(f"agent.tasks: {error}")
    if agent.reward is not None:
        from roll.rewards import REWARD_FUNCTIONS

        try:
            REWARD_FUNCTIONS.get(agent.reward)
        except KeyError as error:
            problems.append(f"agent.reward: {error.args[0]}")
    return problems


class TaskList:
    """The tasks of a run, read from a dataset file (any format ``roll train`` reads). Seeds index them:
    ``0 .. held_out - 1`` are the held-out tasks, and training seeds (``held_out`` upwards) go round the
    rest, epoch after epoch. ``layout`` is what ``SeedOrder`` asks an env: no two seeds share a task
    across the split, so nothing needs skipping."""

    def __init__(self, path: str | Path, held_out: int):
        self.path = str(path)
        self.rows = [row for _, row in read_rows(path)]
        self.held_out = held_out
        if len(self.rows) <= held_out:
            raise ValueError(
                f"{path} holds {len(self.rows)} tasks; eval.seeds ({held_out}) holds the first of them out, "
                "leaving none to train on: add tasks or lower eval.seeds"
            )

    def task(self, seed: int) -> dict[str, Any]:
        if seed < self.held_out:
            return self.rows[seed]
        return self.rows[self.held_out + (seed - self.held_out) % (len(self.rows) - self.held_out)]

    def layout(self, seed: int) -> None:
        return None


@dataclass
class AgentOutcome:
    """How a run ended: its ``reward``, or ``failure`` (``agent_error``: it raised; ``agent_timeout``: past
    its wall-time bound; ``no_reward``: it returned None and posted none) with ``error`` saying why."""

    reward: float | None = None
    failure: str | None = None
    error: str | None = None


logger = logging.getLogger(__name__)

# How often the loop's watch wakes, and how late a wake must be to count as the loop blocked (asyncio's
# debug mode calls a callback slow from 0.1 s).
WATCH_EVERY_S, BLOCKED_AFTER_S = 0.05, 0.1


class AgentRunner:
    """Runs ``entrypoint`` (see the module docstring) on an asyncio loop of its own thread.

    An async agent that runs blocking code (``time.sleep``, a synchronous HTTP client, heavy computing)
    holds up every run on the loop. A watch wakes every ``WATCH_EVERY_S``; a wake later than
    ``BLOCKED_AFTER_S`` counts as the loop blocked for that long (``take_blocked``)."""

    def __init__(self, entrypoint: Callable[..., Any], api_key: str = "roll", concurrency: int | None = None):
        self.entrypoint = entrypoint
        self.api_key = api_key
        self.is_async = inspect.iscoroutinefunction(entrypoint)
        self.name = f"{getattr(entrypoint, '__module__', '?')}:{getattr(entrypoint, '__name__', '?')}"
        self._blocked = [0.0, 0.0]  # seconds blocked in all, and the longest, since blocked_metrics
        self._blocked_lock = threading.Lock()
        # One TLS context for every run's client: a client makes its own by default, loading the CA
        # bundle (about 50 ms here) on the agents' loop, where hundreds of runs a step would block it.
        self._tls = ssl.create_default_context()
        # At most ``concurrency`` runs play at once (None: all that start); the rest wait their turn in
        # start order, their clocks not yet running.
        self._slots = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
        self.concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-runs", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._watch(), self._loop)

    async def _watch(self) -> None:
        loop = self._loop
        while True:
            due = loop.time() + WATCH_EVERY_S
            await asyncio.sleep(WATCH_EVERY_S)
            late = loop.time() - due
            if late > BLOCKED_AFTER_S:
                with self._blocked_lock:
                    self._blocked[0] += late
                    self._blocked[1] = max(self._blocked[1], late)

    def blocked_metrics(self) -> dict[str, float]:
        """``agent/loop_blocked_s``: the seconds the loop was blocked since the last call; past a second,
        a warning names the agent that blocks it."""
        with self._blocked_lock:
            (total, longest), self._blocked = self._blocked, [0.0, 0.0]
        if total > 1.0:
            logger.warning(
                "the agents' event loop was blocked for %.1f s (at most %.1f s at once), holding up every "
                "run meanwhile: the async agent %s runs blocking code (time.sleep, a synchronous client, "
                "heavy computing); await instead, use asyncio.to_thread, or make it a plain function "
                "(each run of one gets a thread of its own)",
                total,
                longest,
                self.name,
            )
        return {"agent/loop_blocked_s": total}

    def start(
        self,
        task: dict[str, Any],
        base_url: str,
        timeout_s: float,
        reward_after: Callable[[], float | None],
        on_done: Callable[[AgentOutcome], None],
    ) -> Future:
        """Start one run of the agent on ``task`` against ``base_url`` (once a slot is free, with
        ``concurrency`` set: its ``timeout_s`` counts from then); ``on_done(outcome)`` is called (on the
        loop's thread) when it ends, unless it was cancelled. ``reward_after()``: the run's reward when
        the agent returned None (one it posted, or its transcript scored; None: none), called on a thread.
        Returns the run's future (``cancel``)."""

        async def run() -> None:
            try:
                async with self._slots:
                    outcome = await self._play(task, base_url, timeout_s, reward_after)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - whatever failed, the scheduler must hear of the run
                outcome = AgentOutcome(failure="agent_error", error=f"{type(error).__name__}: {error}")
            on_done(outcome)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    async def _play(
        self, task: dict[str, Any], base_url: str, timeout_s: float, reward_after: Callable[[], float | None]
    ) -> AgentOutcome:
        import openai

        options = {"base_url": base_url, "api_key": self.api_key, "max_retries": CLIENT_RETRIES}
        try:
            if self.is_async:
                http = openai.DefaultAsyncHttpxClient(verify=self._tls)
                async with openai.AsyncOpenAI(**options, timeout=timeout_s, http_client=http) as client:
                    returned = await asyncio.wait_for(self.entrypoint(client, task), timeout_s)
            else:
                http = openai.DefaultHttpxClient(verify=self._tls)
                with openai.OpenAI(**options, timeout=timeout_s, http_client=http) as client:
                    returned = await self._in_thread(client, task, timeout_s)
        except asyncio.TimeoutError:
            return AgentOutcome(failure="agent_timeout", error=f"the agent ran past {timeout_s:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the user's program failed: the run is dropped, counted
            return AgentOutcome(failure="agent_error", error=f"{type(error).__name__}: {error}")
        try:
            reward = await asyncio.to_thread(reward_after) if returned is None else returned
        except Exception as error:  # noqa: BLE001 - the transcript's reward function failed
            return AgentOutcome(
                failure="no_reward", error=f"the reward failed: {type(error).__name__}: {error}"
            )
        if reward is None:
            return AgentOutcome(
                failure="no_reward",
                error="the agent returned None, posted no reward for its session, and agent.reward is unset",
            )
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return AgentOutcome(
                failure="agent_error",
                error=f"the agent returned {reward!r}: a reward must be a finite number",
            )
        return AgentOutcome(reward=float(reward))

    async def _in_thread(self, client: Any, task: dict[str, Any], timeout_s: float) -> Any:
        """The plain function on a thread started now, within ``timeout_s``."""
        loop = self._loop
        future = loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            if not future.done():  # not timed out or cancelled meanwhile
                outcome()

        def call() -> None:
            try:
                returned = self.entrypoint(client, task)
            except BaseException as error:  # noqa: BLE001 - handed to the run, as an async agent's would be
                failure = error  # (``error`` is unbound after the except block)
                report = lambda: settle(lambda: future.set_exception(failure))  # noqa: E731
            else:
                report = lambda: settle(lambda: future.set_result(returned))  # noqa: E731
            try:
                loop.call_soon_threadsafe(report)
            except RuntimeError:  # the loop was closed (the run ended with the runner): nobody waits
                pass

        threading.Thread(target=call, name="agent-run", daemon=True).start()
        return await asyncio.wait_for(future, timeout_s)

    def close(self) -> None:
        """Cancel what still runs and stop the loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - shutting down: what could not be cancelled is left
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
