"""What every rollout scheduler shares: RLVR's ``RolloutScheduler`` (one response per sample, then a reward)
and agentic's ``EpisodeScheduler`` (turns and environment steps) both play groups through the rollout
workers and hand the pipeline a batch of them at a time.

The work happens in rounds (``_pump``: send what is wanted, wait a little for results, react). With
synchronous training (``async_generation_ratio`` 0) the rounds run inside ``next_batch`` only, so nothing
generates while the actor trains. With ratio r > 0 a background thread runs them all the time, the
pipeline's calls only wait for it, and a group holding a token older than r weights versions before the
current one is stale (``stale_before``): the subclass drops it and draws again.
"""

from __future__ import annotations

import abc
import threading
from typing import Any

from roll.data.batch import Batch


class GroupScheduler(abc.ABC):
    """Base of a scheduler whose ``spec`` has ``async_generation_ratio``. A subclass gives one round
    (``_pump``), the groups of the next batch once they are ready (``_take_batch``, under the lock) and
    the batch made of them (``_batch``)."""

    spec: Any
    thread_name = "rollout-scheduler"

    def __init__(self) -> None:
        self.weights_version = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified whenever the state moved
        self._waiting = False  # a next_batch call wants a batch
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # what stopped the background thread, for next_batch
        self._closed = False

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The next training batch and its rollout metrics."""
        with self._lock:
            self._waiting = True
            self._changed.notify_all()
        try:
            if self.spec.async_generation_ratio and self._thread is None:
                self._thread = threading.Thread(target=self._pump_forever, name=self.thread_name, daemon=True)
                self._thread.start()
            groups = self._until(self._take_batch)
        finally:
            with self._lock:
                self._waiting = False
        return self._batch(groups)

    def set_weights_version(self, version: int) -> None:
        """The rollout workers now hold weights ``version``: older in-flight work may become stale."""
        with self._lock:
            self.weights_version = version
            self._changed.notify_all()

    def stale_before(self) -> int:
        """The oldest weights version a trained token may come from."""
        return self.weights_version - self.spec.async_generation_ratio

    def _stop_pumping(self) -> None:
        """End the background thread (``close``'s first part); the subclass then aborts what is live."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _until(self, ready: Any) -> Any:
        """Pump (or, asynchronously, wait for the pumping thread) until ``ready()`` returns a value."""
        while True:
            with self._changed:
                if self._error is not None:
                    # The worker's own error, not a wrapper: the pipeline recovers from a lost worker by
                    # its type, and it names the role, rank and method already.
                    raise self._error
                value = ready()
                if value is not None:
                    return value
                if self._thread is not None:
                    self._changed.wait(1.0)
                    continue
            self._pump()

    def _pump_forever(self) -> None:
        try:
            while not self._closed:
                self._pump()
        except BaseException as error:  # noqa: BLE001 - handed to the pipeline's next_batch
            with self._lock:
                self._error = error
                self._changed.notify_all()

    @abc.abstractmethod
    def _pump(self) -> None:
        """One round: send what is wanted, wait a little for results, react to them."""

    @abc.abstractmethod
    def _take_batch(self) -> Any:
        """The groups of the next batch, taken out of the live ones, or None while they are not ready."""

    @abc.abstractmethod
    def _batch(self, groups: Any) -> tuple[Batch, dict[str, float]]:
        """The training batch of ``groups`` and its metrics."""
