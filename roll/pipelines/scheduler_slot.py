"""The run's one rollout scheduler over its lifetime: made over the live rollout workers (or the actor, as
a hybrid engine), closed when workers stop, and rebuilt from its own state around a replacement of the
workers it depends on. Each scheduler after the first prefixes its request ids, so late results meant
for the one before never reach it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from roll.rollout.backend import BatchBackend, RayBackend, RewardDispatch, RolloutBackend
from roll.rollout.router import RolloutRouter

# How long a new scheduler waits for a closed one's open calls on rollout workers it takes over (a
# collect_finished returns within the router's 1 s wait).
DRAIN_S = 5.0


class SchedulerSlot:
    """Holds ``current``, the scheduler a pipeline's ``make_scheduler(backend, id_prefix)`` made.

    Args:
        make_scheduler: the pipeline's factory.
        reward_dispatch: where finished samples are scored.
        weights_version: the weights version the rollout workers hold now (a new scheduler starts at it).
    """

    def __init__(
        self,
        make_scheduler: Callable[[RolloutBackend, str], Any],
        reward_dispatch: Callable[[], RewardDispatch],
        weights_version: Callable[[], int],
    ):
        self.make_scheduler = make_scheduler
        self.reward_dispatch = reward_dispatch
        self.weights_version = weights_version
        self.current: Any = None
        self._made = 0
        self._draining: RolloutBackend | None = None  # a closed scheduler's backend, see close

    def start(self, rollout: Any, actor: Any) -> Any:
        """A new scheduler over ``rollout`` workers (None: generation on the ``actor``)."""
        if self._draining is not None:
            self._draining.drain(DRAIN_S)
            self._draining = None
        if rollout is None:
            backend: RolloutBackend = BatchBackend(actor, self.reward_dispatch())
        else:
            backend = RayBackend(RolloutRouter(rollout), self.reward_dispatch())
        prefix = f"s{self._made}-" if self._made else ""
        self._made += 1
        self.current = self.make_scheduler(backend, prefix)
        self.current.set_weights_version(self.weights_version())
        return self.current

    def close(self, keeps_rollout: bool) -> None:
        """Close the scheduler. Its calls still open on rollout workers that stay for the next one are
        drained before that one starts, so none takes results meant for it."""
        if self.current is None:
            return
        self.current.close()
        self._draining = self.current.backend if keeps_rollout else None
        self.current = None

    @contextlib.contextmanager
    def rebuilt(self, keeps_rollout: bool, workers: Callable[[], tuple[Any, Any]]) -> Iterator[None]:
        """The scheduler closed while lost workers it depends on are replaced (``Supervisor.replace``),
        then started again over ``workers()`` (rollout, actor) from the old one's state, so the work in
        flight is done again by the new workers."""
        state = self.current.state_dict()
        self.close(keeps_rollout)
        yield
        self.start(*workers())
        self.current.load_state_dict(state)
