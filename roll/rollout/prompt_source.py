"""Where the rollout scheduler's prompts come from: the prompts of dropped groups first, in the order they
were drawn, then the dataset's order, with at most ``budget`` fresh prompts between two batches (dynamic
sampling stops drawing there). Resumable: a checkpoint holds the dataset cursor and every prompt drawn
but not trained on."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from roll.data.dataset import PromptIterator


class PromptSource:
    """Prompt indices for new groups. ``order``: the dataset cursor (seeded, resumable); ``budget``: most
    fresh prompts between two batches (``new_batch``)."""

    def __init__(self, order: PromptIterator, budget: int):
        self.order, self.budget = order, budget
        self._queue: collections.deque[int] = collections.deque()  # drawn from the order, not yet used
        self._returned = 0  # how many at the front of the queue came back from dropped groups
        self._fresh = 0  # fresh prompts taken since the last batch

    def next(self) -> int | None:
        """The next prompt index, or None while the budget is spent."""
        if self._returned:
            self._returned -= 1
            return self._queue.popleft()
        if self._fresh >= self.budget:
            return None
        if not self._queue:
            self._queue.extend(self.order.next_indices())
        self._fresh += 1
        return self._queue.popleft()

    def put_back(self, indices: Sequence[int]) -> None:
        """Dropped groups' prompts, in draw order: drawn again before anything else, in that order."""
        self._queue.extendleft(reversed(indices))
        self._returned += len(indices)

    def can_draw(self) -> bool:
        return bool(self._returned) or self._fresh < self.budget

    def new_batch(self) -> None:
        """A batch was handed out: the budget starts again."""
        self._fresh = 0

    def state_dict(self, in_flight: Sequence[int]) -> dict[str, Any]:
        """The cursor, and the prompts ``in_flight`` (in live groups, in draw order) followed by those
        queued: a source that loads it gives them first, then continues the dataset."""
        return {"prompt_order": self.order.state_dict(), "pending_prompts": [*in_flight, *self._queue]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state["prompt_order"])
        self._queue.extend(int(i) for i in state["pending_prompts"])
        self._returned = len(self._queue)
