"""Name -> object registries, so a new estimator, loss or reward is one function plus one entry."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def did_you_mean(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    """Return ' Did you mean 'x'?' for the closest candidate, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


class Registry(Generic[T]):
    """A named collection of functions or classes, filled with the ``register`` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(
                f"unknown {self.kind} '{name}'.{did_you_mean(name, self.names())} "
                f"Available: {', '.join(self.names())}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
