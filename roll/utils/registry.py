"""Name -> object registries, so a new estimator, loss or reward is one function plus one entry."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

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
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[T], T]:
        """Decorator adding ``obj`` under ``name``; ``traits`` are facts the caller checks before use
        (e.g. an advantage estimator's ``needs_values=True``), read back with ``traits(name)``."""

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = obj
            self._traits[name] = traits
            return obj

        return decorator

    def traits(self, name: str) -> dict[str, Any]:
        """The keyword arguments ``name`` was registered with (empty when none)."""
        self.get(name)  # the same unknown-name error as get()
        return dict(self._traits.get(name, {}))

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


def accepted_kwargs(fn: Callable[..., Any], available: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``available`` that ``fn`` declares as parameters (all of it if ``fn`` takes
    ``**kwargs``). Lets the config offer every knob while each registered function names only the ones
    it uses, so a user's function receives e.g. ``gamma`` just by declaring it."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(available)
    names = {p.name for p in parameters}
    return {k: v for k, v in available.items() if k in names}
