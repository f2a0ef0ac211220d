"""Training metrics to the console, a JSONL file and TensorBoard.

A pipeline makes one ``Tracker`` per run and calls ``tracker.log(step, metrics)`` once per step, with
``step`` counting finished steps from 1, so the progress bar ends at ``total_steps/total_steps``.
Metric names are slash-separated (``reward/mean``, ``eval/score``, ``time/step_s``); any name whose
prefix is ``eval/`` is an evaluation result and is never skipped by ``log_every``.

A new sink (W&B, MLflow) is one ``TrackingBackend`` subclass plus one ``TRACKER_BACKENDS`` entry. Heavy
dependencies are imported inside the backend so that ``import roll.tracking`` stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from roll.utils.registry import Registry

EVAL_PREFIX = "eval/"
REWARD_KEY = "reward/mean"
EVAL_SCORE_KEY = "eval/score"
STEP_TIME_KEY = "time/step_s"
# Shown in the one-line console summary when present; a metric matches when its name is the label, ends
# in "/<label>", or is "<label>/mean", so "actor/kl", "kl/mean" and "kl" all count as "kl".
SUMMARY_EXTRAS = ("kl", "entropy", "grad_norm")


@dataclass(frozen=True)
class TrackingContext:
    """What every backend may need to start; one object so adding a field does not change signatures."""

    output_dir: Path
    run_name: str
    total_steps: int
    console: Console
    config: Mapping[str, Any] | None = field(default=None)


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


TRACKER_BACKENDS: Registry[type[TrackingBackend]] = Registry("tracking backend")


def _format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _find_extra(metrics: Mapping[str, float], label: str) -> str | None:
    for key in metrics:
        if key == label or key.endswith(f"/{label}") or key == f"{label}/mean":
            return key
    return None


@TRACKER_BACKENDS.register("console")
class ConsoleBackend(TrackingBackend):
    """A live progress bar on a terminal; one plain line per recorded step anywhere else.

    CI logs and pipes get no live bar because redrawing it there produces either nothing until the end or
    a flood of partial frames; a line per recorded step is what a reader of a log file wants.
    """

    def __init__(self, context: TrackingContext) -> None:
        super().__init__(context)
        self.console = context.console
        # The bar shows the latest value of each of these, so an eval-only step does not blank the reward.
        self.latest: dict[str, float] = {}
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                # markup off: metric values must never be parsed as rich tags.
                TextColumn("{task.fields[summary]}", markup=False),
                console=self.console,
            )
            self.task = self.progress.add_task(
                escape(context.run_name), total=context.total_steps, summary=""
            )
            self.progress.start()

    def summary(self, metrics: Mapping[str, float], extras: bool) -> str:
        parts: list[str] = []
        if REWARD_KEY in metrics:
            parts.append(f"reward {_format_value(metrics[REWARD_KEY])}")
        if EVAL_SCORE_KEY in self.latest:
            parts.append(f"eval {_format_value(self.latest[EVAL_SCORE_KEY])}")
        if STEP_TIME_KEY in metrics:
            parts.append(f"{metrics[STEP_TIME_KEY]:.3g} s/step")
        if extras:
            for label in SUMMARY_EXTRAS:
                key = _find_extra(metrics, label)
                if key is not None:
                    parts.append(f"{label} {_format_value(metrics[key])}")
        return " | ".join(parts)

    def advance(self, step: int, metrics: Mapping[str, float]) -> None:
        for key in (REWARD_KEY, EVAL_SCORE_KEY, STEP_TIME_KEY):
            if key in metrics:
                self.latest[key] = metrics[key]
        if self.progress is not None and self.task is not None:
            self.progress.update(
                self.task,
                completed=min(step, self.context.total_steps),
                summary=self.summary(self.latest, False),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        total = self.context.total_steps
        train_metrics = {k: v for k, v in metrics.items() if not k.startswith(EVAL_PREFIX)}
        # An eval-only call would repeat the previous line; its own eval line below says everything.
        # In a log file about a hundred step lines per run are readable; thousands are not.
        every = max(1, total // 100)
        if self.progress is None and train_metrics and (step % every == 0 or step == total):
            summary = self.summary(train_metrics, True)
            self._print(f"step {step}/{total}" + (f" | {summary}" if summary else ""))
        eval_metrics = {k: v for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}
        if eval_metrics:
            values = ", ".join(f"{k}={_format_value(v)}" for k, v in eval_metrics.items())
            self._print(f"eval @ step {step}: {values}")

    def _print(self, line: str) -> None:
        # soft_wrap: a log line must stay one line in CI logs, however narrow the console thinks it is.
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


@TRACKER_BACKENDS.register("jsonl")
class JsonlBackend(TrackingBackend):
    """Appends ``{"step", "time", **metrics}`` to ``<output_dir>/metrics.jsonl``, one line per record.

    Each line is flushed as it is written, so a crashed process loses no recorded step. NaN and infinity
    are written as ``null`` (the key is kept) because JSON has no literal for them and most readers
    reject Python's ``NaN`` extension. Appending (not truncating) keeps the history of a resumed run.
    """

    RESERVED_KEYS = ("step", "time")

    def __init__(self, context: TrackingContext) -> None:
        super().__init__(context)
        self.path = context.output_dir / "metrics.jsonl"
        self.file: IO[str] = self._open()

    def _open(self) -> IO[str]:
        """Open for appending; a last line that a killed process left half-written is ended first, so
        the next record starts a line of its own."""
        file = self.path.open("a+", encoding="utf-8")
        if file.tell() > 0:
            file.seek(file.tell() - 1)
            if file.read(1) != "\n":
                file.write("\n")
        return file

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clash = [key for key in self.RESERVED_KEYS if key in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved by the JSONL record; rename them")
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            record[key] = value if math.isfinite(value) else None
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def rewind(self, step: int) -> None:
        """Rewrite the file without the rows after ``step`` (atomically: a crash keeps the old file)."""
        self.file.close()
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass  # a line a killed process left half-written: no step to keep
        staging = self.path.with_name(f".{self.path.name}.rewind")
        staging.write_text("".join(kept), encoding="utf-8")
        os.replace(staging, self.path)
        self.file = self._open()

    def close(self) -> None:
        self.file.close()


@TRACKER_BACKENDS.register("tensorboard")
class TensorBoardBackend(TrackingBackend):
    """Scalars to ``<output_dir>/tensorboard``; the config, when given, as the text entry ``config``."""

    # The writer's default (120 s) leaves a live TensorBoard two minutes behind a fast CPU run.
    FLUSH_SECS = 10

    def __init__(self, context: TrackingContext) -> None:
        super().__init__(context)
        # Imported here: it pulls in tensorboard and protobuf, which a metrics-free import should not pay for.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(context.output_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=self.FLUSH_SECS)
        if context.config is not None:
            text = json.dumps(dict(context.config), indent=2, default=str)
            # Four-space indent makes TensorBoard's markdown renderer show it as a code block.
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def rewind(self, step: int) -> None:
        """A new event file whose ``purge_step`` makes TensorBoard drop the old events after ``step``."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=self.FLUSH_SECS, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


def _as_number(key: str, value: Any) -> float:
    """Plain Python number for one metric; ints stay ints so counts read naturally in the JSONL."""
    try:
        if hasattr(value, "item"):  # tensors, numpy scalars and arrays; fails unless one element
            value = value.item()
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return float(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"metric '{key}' must be a number or a one-element tensor/array, got {type(value).__name__}"
        ) from error


class Tracker:
    """Fans one run's metrics out to the chosen backends and owns the console for the run's messages.

    Every ``log`` call moves the progress bar; backends record a step when ``step % log_every == 0`` or
    when the metrics contain an ``eval/`` entry, so evaluation results are never thinned out.
    """

    def __init__(
        self,
        output_dir: str | Path,
        run_name: str,
        total_steps: int,
        backends: Sequence[str] = ("console", "jsonl", "tensorboard"),
        log_every: int = 1,
        config: Mapping[str, Any] | None = None,
        console: Console | None = None,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        # Resolve every name first so a typo fails before any file or display is created.
        classes = [TRACKER_BACKENDS.get(name) for name in dict.fromkeys(backends)]
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.log_every = log_every
        self.console = console if console is not None else Console()
        context = TrackingContext(self.output_dir, run_name, total_steps, self.console, config)
        self.backends: list[TrackingBackend] = []
        self.closed = False
        try:
            for cls in classes:
                self.backends.append(cls(context))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.closed:
            raise RuntimeError("Tracker.log called after close()")
        values = {key: _as_number(key, value) for key, value in metrics.items()}
        for backend in self.backends:
            backend.advance(step, values)
        if step % self.log_every == 0 or any(key.startswith(EVAL_PREFIX) for key in values):
            for backend in self.backends:
                backend.log(step, values)

    def rewind(self, step: int) -> None:
        """Drop what every backend recorded after ``step`` (resuming from a checkpoint of that step)."""
        for backend in self.backends:
            backend.rewind(step)

    def print(self, message: str) -> None:
        """Print plain text (no rich markup is interpreted) above the progress bar."""
        self.console.print(message, markup=False, soft_wrap=True)

    def close(self) -> None:
        """Close every backend once; later calls do nothing. The first backend error is re-raised."""
        if self.closed:
            return
        self.closed = True
        first_error: BaseException | None = None
        for backend in self.backends:
            try:
                backend.close()
            except BaseException as error:  # close the rest before reporting
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
