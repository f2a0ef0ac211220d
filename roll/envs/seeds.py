"""Training and held-out seeds kept apart by task, not only by number.

The held-out seeds are ``0 .. held_out - 1``. Training seeds count up from ``held_out`` and skip every
seed whose task (``TextEnv.layout``) is one of the held-out tasks: a 4x4 FrozenLake has few enough
maps that distinct seeds repeat maps, and a held-out map seen in training would measure memory, not
generalisation.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

from roll.envs.base import TextEnv


def held_out_seeds(count: int) -> list[int]:
    return list(range(count))


# Consecutive seeds whose tasks are all held-out ones before the search gives up: an env with fewer
# tasks than held-out seeds would otherwise search forever.
MAX_SKIPPED = 10_000


def training_seeds(env: TextEnv, held_out: int, start: int = 0) -> Iterator[int]:
    """Training seeds in order, from the ``start``-th one (resumable): ``held_out`` upwards, without the
    seeds whose layout is a held-out seed's.

    Raises:
        ValueError: ``MAX_SKIPPED`` seeds in a row repeat held-out tasks (too few tasks left to train on).
    """
    excluded = {env.layout(seed) for seed in held_out_seeds(held_out)} - {None}
    seed, index, skipped = held_out, 0, 0
    while True:
        if not excluded or env.layout(seed) not in excluded:
            if index >= start:
                yield seed
            index, skipped = index + 1, 0
        else:
            skipped += 1
            if skipped >= MAX_SKIPPED:
                raise ValueError(
                    f"{MAX_SKIPPED} seeds in a row from {seed - skipped + 1} repeat held-out tasks: the env "
                    f"has too few distinct tasks beside the {held_out} held-out seeds; lower eval.seeds"
                )
        seed += 1


class SeedOrder:
    """Training seeds in order (``roll.envs.seeds.training_seeds``: never a held-out task), resumable.
    Seeds of groups drawn but not trained on (a step cut short by a lost worker) are drawn again first."""

    def __init__(self, env: TextEnv, held_out: int):
        self.env, self.held_out = env, held_out
        self.drawn = 0
        self.pending: collections.deque[int] = collections.deque()
        self._seeds: Iterator[int] = training_seeds(env, held_out)

    def next(self) -> int:
        if self.pending:
            return self.pending.popleft()
        self.drawn += 1
        return next(self._seeds)

    def put_back(self, seeds: Sequence[int]) -> None:
        """Seeds of dropped groups, in draw order: drawn again first, in that order."""
        self.pending.extendleft(reversed(seeds))

    def state_dict(self, in_flight: Sequence[int] = ()) -> dict[str, Any]:
        """The cursor, with ``in_flight`` (drawn, not trained on, in draw order) drawn again first."""
        return {"drawn": self.drawn, "pending": [*in_flight, *self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])
        self.pending = collections.deque(int(s) for s in state["pending"])
        self._seeds = training_seeds(self.env, self.held_out, start=self.drawn)
