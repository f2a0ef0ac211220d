"""What ``roll.tracking`` and the trackers in this package share: the backend base class, what a backend
starts from, and the registry of backends by name. Its own module so that both import it and neither
imports the other."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll.utils.registry import Registry

if TYPE_CHECKING:
    from rich.console import Console

    from roll.config.common import TrackingConfig


@dataclass(frozen=True)
class TrackingContext:
    """What every backend may need to start; one object so adding a field does not change signatures."""

    output_dir: Path
    run_name: str
    total_steps: int
    console: Console
    config: Mapping[str, Any] | None = field(default=None)
    # The run's ``tracking`` section, for backends with options of their own (``tracking.wandb``).
    options: TrackingConfig | None = None
    # Set when the run resumes from a checkpoint that saved the tracker's state.
    resume: TrackerResume | None = None

    def section(self, name: str) -> Any:
        """The run's ``tracking.<name>`` options, which a backend with options of its own reads."""
        if self.options is None:
            raise ValueError(f"the {name} tracking backend reads tracking.{name}: pass Tracker(options=...)")
        return getattr(self.options, name)


@dataclass(frozen=True)
class TrackerResume:
    """What a checkpoint kept of the tracker: its step, and each backend's ``state()`` by backend name."""

    step: int
    states: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


class TrackingBackend(ABC):
    """One metrics sink. ``advance`` sees every step; ``log`` only the steps that are recorded."""

    def __init__(self, context: TrackingContext) -> None:
        self.context = context

    def advance(self, step: int, metrics: Mapping[str, float]) -> None:  # noqa: B027 - optional hook
        """Called on every ``Tracker.log`` call, including those that ``log_every`` skips."""

    @abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of one step."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release resources; called once by the tracker."""

    def rewind(self, step: int) -> None:  # noqa: B027 - optional hook
        """Forget every record after ``step``: the run goes on from a checkpoint of that step, and each
        step must appear once."""

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:  # noqa: B027 - optional hook
        """Record example generations of ``step``: one dict per sample, the same keys in each."""

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps so that a run resumed from it continues this backend's run (a run id,
        JSON-serialisable); None for a backend with nothing to continue."""
        return None


TRACKER_BACKENDS: Registry[type[TrackingBackend]] = Registry("tracking backend")
