"""What every rollout scheduler shares: RLVR's ``RolloutScheduler`` (one response per sample, then a reward)
and agentic's ``EpisodeScheduler`` (turns and environment steps) both play groups through the rollout
workers and hand the pipeline a batch of them at a time.

The core is the same for both: training groups are drawn from a source (prompt indices, env seeds) and
kept in draw order until they go into a batch; a batch takes the first groups in draw order once they are
ready, never the first to finish (that would favour short responses and quick episodes). The work happens
in rounds (``_pump``: send what is wanted, wait a little for results, react). With synchronous training
(``async_generation_ratio`` 0) the rounds run inside ``next_batch`` only, so nothing generates while the
actor trains. With ratio r > 0 a background thread runs them all the time, the pipeline's calls only
wait for it, and a group holding a token older than r weights versions before the current one is stale
(``stale_before``): it is dropped and its source item drawn again first.

What differs is the group's workflow, which the subclass gives: how its groups open (``_open``: send
requests, or reset environments), how one round plays them (``_pump``), how a group ends early (``_drop``)
and what a batch of them is (``_batch``). Their I/O stays with the scheduler, not with each group, so
that one round makes one call per worker for all groups.
"""

from __future__ import annotations

import abc
import collections
import itertools
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from roll.data.batch import Batch


class Source(Protocol):
    """Where training groups come from, resumably: the items of dropped groups are drawn again first."""

    def next(self) -> Any:
        """The next item, or None while none may be drawn."""

    def put_back(self, items: Sequence[Any]) -> None:
        """Items of dropped groups, in draw order: drawn again before anything else."""

    def state_dict(self, in_flight: Sequence[Any]) -> dict[str, Any]:
        """The cursor, with ``in_flight`` (drawn, not trained on, in draw order) to be drawn again first."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Group(Protocol):
    group_id: int

    @property
    def item(self) -> Any:
        """What its source gave it (a prompt index, a seed)."""

    @property
    def ready(self) -> bool:
        """Complete and kept: it may go into a batch."""

    def oldest_version(self) -> int | None:
        """The oldest weights version of any of its tokens (None while nothing of it was sent)."""


class GroupScheduler(abc.ABC):
    """Base of a scheduler whose ``spec`` has ``async_generation_ratio``. A subclass gives the number of
    groups in a batch (``groups_per_batch``), how new groups open (``_open``) and end early (``_drop``),
    one round (``_pump``), and the batch made of ready groups (``_batch``).

    ``source``: the training groups' items; ``extra_groups``: groups that may play beyond those a batch
    still needs (dynamic sampling's surplus, spare groups); ``in_draw_order``: a batch is the first groups
    in draw order (False: the first ready ones in draw order, past any still playing: for spare groups
    where no order is favoured, an imitation warm start's)."""

    spec: Any
    source: Source
    groups_per_batch: int
    extra_groups = 0
    in_draw_order = True
    thread_name = "rollout-scheduler"

    def __init__(self) -> None:
        self.weights_version = 0
        self._drawn: dict[int, Group] = {}  # training groups drawn, not yet in a batch, in draw order
        self._next_group_id = 0
        self._counts: collections.Counter[str] = collections.Counter()  # since the last batch
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

    def state_dict(self) -> dict[str, Any]:
        """The source's cursor and the items of the groups drawn but not trained on, in draw order: a
        scheduler that loads it draws them again first, then continues."""
        with self._lock:
            return self.source.state_dict([group.item for group in self._drawn.values()])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            if self._next_group_id:
                raise RuntimeError("load_state_dict must come before the scheduler draws anything")
            self.source.load_state_dict(state)

    @property
    def batch_ready(self) -> bool:
        """Whether ``next_batch`` would return its groups at once (asynchronously: played ahead)."""
        with self._lock:
            first = self._leading_ready()
            return first is not None and len(first) == self.groups_per_batch

    def set_weights_version(self, version: int) -> None:
        """The rollout workers now hold weights ``version``: older in-flight work may become stale."""
        with self._lock:
            self.weights_version = version
            self._changed.notify_all()

    def stale_before(self) -> int:
        """The oldest weights version a trained token may come from."""
        return self.weights_version - self.spec.async_generation_ratio

    def _new_group_id(self) -> int:
        self._next_group_id += 1
        return self._next_group_id - 1

    def _draw(self) -> None:
        """Draw training groups until enough are ready or playing for the batches wanted (the one
        ``next_batch`` waits for, and the next ``async_generation_ratio`` ones) plus ``extra_groups``."""
        wanted = (self.spec.async_generation_ratio + int(self._waiting)) * self.groups_per_batch
        ready = sum(1 for group in self._drawn.values() if group.ready)
        if wanted <= ready:
            return
        playing = len(self._drawn) - ready
        items = []
        while playing + len(items) < wanted - ready + self.extra_groups:
            item = self.source.next()
            if item is None:
                break
            items.append(item)
        self._draw_items(items)

    def _draw_items(self, items: list[Any]) -> None:
        for group in self._open(items):
            self._drawn[group.group_id] = group

    def _is_stale(self, group: Group) -> bool:
        """Tokens (or, before the first, the start) older than the staleness bound allows."""
        oldest = group.oldest_version()
        return bool(self.spec.async_generation_ratio) and oldest is not None and oldest < self.stale_before()

    def _drop_stale(self) -> None:
        """Drop the stale groups; their items are drawn again first, in draw order."""
        stale = [group for group in self._drawn.values() if self._is_stale(group)]
        self._drop_and_redraw(stale)
        self._counts["stale_groups"] += len(stale)

    def _drop_and_redraw(self, groups: list[Group]) -> None:
        """Drop drawn ``groups`` (in draw order); their items are drawn again first, in that order."""
        for group in groups:
            self._drop(group)
            del self._drawn[group.group_id]
        self.source.put_back([group.item for group in groups])

    def _lose(self, group: Group, what: str, why: str, errors: list[str]) -> None:
        """A training group that can no longer complete (its members failed): forgotten, its item not
        drawn again (the next draw takes its place: an item that always fails would otherwise come back
        forever), counted; more than ``spec.max_dropped_groups`` in one step stop the run with the last
        of ``errors``. ``what`` the groups are and ``why`` they failed, for that message."""
        del self._drawn[group.group_id]
        self._counts["dropped_groups"] += 1
        if self._counts["dropped_groups"] > self.spec.max_dropped_groups:
            raise RuntimeError(
                f"{self._counts['dropped_groups']} {what} were dropped in one step because {why}; "
                f"the last error: {errors[-1] if errors else 'unknown'}"
            )

    def _leading_ready(self) -> list[Group] | None:
        """The ready groups at the front of the draw order (at most ``groups_per_batch``), or None while a
        drawn group is stale (the pumping thread drops those first)."""
        if any(self._is_stale(group) for group in self._drawn.values()):
            return None
        if self.in_draw_order:
            leading = itertools.takewhile(lambda group: group.ready, self._drawn.values())
        else:
            leading = (group for group in self._drawn.values() if group.ready)
        return list(itertools.islice(leading, self.groups_per_batch))

    def _take_batch(self) -> list[Group] | None:
        """The groups of the next batch, taken out of the drawn ones: the first ``groups_per_batch`` in
        draw order, once all are ready; None while they are not."""
        first = self._leading_ready()
        if first is None or len(first) < self.groups_per_batch:
            return None
        for group in first:
            del self._drawn[group.group_id]
        return first

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
    def _open(self, items: list[Any]) -> list[Any]:
        """New training groups of ``items`` (from the source), started or queued to start."""

    @abc.abstractmethod
    def _drop(self, group: Any) -> None:
        """End a group early: abort what it has in flight (the base forgets it and puts its item back)."""

    @abc.abstractmethod
    def _batch(self, groups: Any) -> tuple[Batch, dict[str, float]]:
        """The training batch of ``groups`` and its metrics."""
