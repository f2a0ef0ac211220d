"""Training metrics to the console, a JSONL file and TensorBoard.

A pipeline makes one ``Tracker`` per run and calls ``tracker.log(step, metrics)`` once per step, with
``step`` counting finished steps from 1, so the progress bar ends at ``total_steps/total_steps``.
Metric names are slash-separated (``reward/mean``, ``eval/score``, ``time/step_s``); any name whose
prefix is ``eval/`` is an evaluation result and is never skipped by ``log_every``; nor is a step with a
``health/`` entry (a run-health monitor fired, ``roll.health``).

``tracker.log_samples(step, samples)`` records a few example generations of a step (prompt, response,
reward, ...) every ``samples_every`` steps: to ``samples.jsonl`` and, in trackers that have them, as tables.

A new sink is one ``TrackingBackend`` subclass plus one ``TRACKER_BACKENDS`` entry (both in
``roll.trackers.base``). Heavy dependencies are imported inside the backend so that ``import roll.tracking``
stays cheap; W&B and MLflow live in ``roll/trackers/`` and register when this module imports that package.

A backend that logs to a run of its own (W&B, MLflow) gives its ``state()`` (the run id) to each checkpoint
(``Tracker.save_state``); a run resumed from that checkpoint gets it back as ``TrackingContext.resume`` and
continues the same run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

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

# The package of the base types also registers W&B and MLflow when it loads.
from roll.trackers.base import TRACKER_BACKENDS, TrackerResume, TrackingBackend, TrackingContext

if TYPE_CHECKING:
    from roll.config.common import TrackingConfig

EVAL_PREFIX = "eval/"
# Steps with these metrics are recorded whatever log_every says: evaluations, and health monitors that
# fired (roll.health), which happen once.
KEPT_PREFIXES = (EVAL_PREFIX, "health/")
REWARD_KEY = "reward/mean"
EVAL_SCORE_KEY = "eval/score"
STEP_TIME_KEY = "time/step_s"
# Shown in the one-line console summary when present; a metric matches when its name is the label, ends
# in "/<label>", or is "<label>/mean", so "actor/kl", "kl/mean" and "kl" all count as "kl".
SUMMARY_EXTRAS = ("kl", "entropy", "grad_norm")


# The tracker's state inside a checkpoint directory: a small JSON file, read before the checkpoint loads.
TRACKER_STATE_FILE = "tracker.json"


def read_tracker_state(checkpoint_dir: Path) -> TrackerResume | None:
    """The tracker's state saved in ``checkpoint_dir``; None when it holds none (no backend had any)."""
    path = Path(checkpoint_dir) / TRACKER_STATE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text(encoding="utf-8"))
    return TrackerResume(int(saved["step"]), saved["backends"])


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


class JsonlFile:
    """An append-only JSONL file of records that each hold a ``step``, flushed per line.

    Appending (not truncating) keeps the history of a resumed run; ``rewind`` cuts the records after a
    step atomically (a crash keeps the old file).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
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

    def append(self, record: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        self.file.flush()

    def rewind(self, step: int) -> None:
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


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@TRACKER_BACKENDS.register("jsonl")
class JsonlBackend(TrackingBackend):
    """Appends ``{"step", "time", **metrics}`` to ``<output_dir>/metrics.jsonl``, one line per record, and
    example generations to ``<output_dir>/samples.jsonl`` (``{"step", **sample}`` per sample).

    Each line is flushed as it is written, so a crashed process loses no recorded step. NaN and infinity
    are written as ``null`` (the key is kept) because JSON has no literal for them and most readers
    reject Python's ``NaN`` extension.
    """

    RESERVED_KEYS = ("step", "time")

    def __init__(self, context: TrackingContext) -> None:
        super().__init__(context)
        self.path = context.output_dir / "metrics.jsonl"
        self.metrics = JsonlFile(self.path)
        self.samples_path = context.output_dir / "samples.jsonl"
        # Opened at the first samples, so a run that logs none leaves no empty file.
        self.samples: JsonlFile | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clash = [key for key in self.RESERVED_KEYS if key in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved by the JSONL record; rename them")
        record: dict[str, Any] = {"step": step, "time": time.time()}
        record.update((key, _finite_or_none(value)) for key, value in metrics.items())
        self.metrics.append(record)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if self.samples is None:
            self.samples = JsonlFile(self.samples_path)
        for sample in samples:
            self.samples.append({"step": step, **{k: _finite_or_none(v) for k, v in sample.items()}})

    def rewind(self, step: int) -> None:
        """Rewrite the files without the records after ``step``."""
        self.metrics.rewind(step)
        if self.samples is None and self.samples_path.exists():
            self.samples = JsonlFile(self.samples_path)
        if self.samples is not None:
            self.samples.rewind(step)

    def close(self) -> None:
        self.metrics.close()
        if self.samples is not None:
            self.samples.close()


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
    when the metrics contain an ``eval/`` or ``health/`` entry, so evaluation results and health alerts are
    never thinned out.
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
        samples_every: int = 0,
        options: TrackingConfig | None = None,
        resume: TrackerResume | None = None,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        # Resolve every name first so a typo fails before any file or display is created.
        self.names = list(dict.fromkeys(backends))
        classes = [TRACKER_BACKENDS.get(name) for name in self.names]
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.log_every = log_every
        self.samples_every = samples_every
        self.console = console if console is not None else Console()
        context = TrackingContext(
            self.output_dir, run_name, total_steps, self.console, config, options=options, resume=resume
        )
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
        if step % self.log_every == 0 or any(key.startswith(KEPT_PREFIXES) for key in values):
            for backend in self.backends:
                backend.log(step, values)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Example generations of ``step``, recorded every ``samples_every`` steps (0: never)."""
        if self.closed:
            raise RuntimeError("Tracker.log_samples called after close()")
        if not samples or not self.samples_every or step % self.samples_every:
            return
        rows = [dict(sample) for sample in samples]
        for backend in self.backends:
            backend.log_samples(step, rows)

    def rewind(self, step: int) -> None:
        """Drop what every backend recorded after ``step`` (resuming from a checkpoint of that step)."""
        for backend in self.backends:
            backend.rewind(step)

    def save_state(self, checkpoint_dir: Path, step: int) -> None:
        """Write the backends' ``state()`` into the checkpoint of ``step`` (nothing when none has any)."""
        states = {name: backend.state() for name, backend in zip(self.names, self.backends, strict=True)}
        states = {name: state for name, state in states.items() if state is not None}
        if states:
            text = json.dumps({"step": step, "backends": states}, indent=1)
            (Path(checkpoint_dir) / TRACKER_STATE_FILE).write_text(text, encoding="utf-8")

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
