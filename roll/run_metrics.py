"""One run's ``metrics.jsonl`` read back as per-metric series, with the three x axes that ``roll plot`` and
``roll compare`` offer: the step, the wall time since the run's first record, and the training samples.

The file is what ``roll.tracking.JsonlBackend`` writes: one ``{"step", "time", **metrics}`` object per line,
``null`` for a non-finite value. Evaluation results may share their step's line or have one of their own
(step 0, the evaluation before training), so each metric becomes its own series over the steps that logged
it. No torch, no Ray, no matplotlib: reading a run must stay cheap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import yaml

METRICS_FILE = "metrics.jsonl"
X_AXES = ("step", "time", "samples")
# Training samples in a step's batch (padding rows excluded): the RL pipelines log the first, SFT the second.
SAMPLE_KEYS = ("rollout/samples", "sft/samples")


class RunMetricsError(ValueError):
    """A run that cannot be read, or a metric or axis that the runs do not have."""


@dataclass(frozen=True)
class Series:
    """One metric of one run in step order; NaN where the run logged ``null``.

    ``seconds``: wall time of each record since the run's first record (the evaluation before training).
    ``samples``: training samples through each step, or None when the run logs no sample count.
    """

    steps: tuple[int, ...]
    values: tuple[float, ...]
    seconds: tuple[float, ...]
    samples: tuple[float, ...] | None

    def x(self, axis: str) -> tuple[float, ...]:
        """The x values on ``axis`` (one of ``X_AXES``)."""
        if axis == "step":
            return tuple(float(s) for s in self.steps)
        if axis == "time":
            return self.seconds
        if axis == "samples":
            if self.samples is None:
                raise RunMetricsError("this run logs no training-sample count")
            return self.samples
        raise RunMetricsError(f"unknown x axis {axis!r}; choose one of {', '.join(X_AXES)}")


@dataclass(frozen=True)
class Run:
    """A run directory's metrics, labelled for legends and tables."""

    path: Path
    label: str
    series: dict[str, Series]
    # The key the sample axis was counted from, None when the run logs none (runs older than that metric).
    sample_key: str | None

    @property
    def last_step(self) -> int:
        return max((s.steps[-1] for s in self.series.values() if s.steps), default=0)

    def matching(self, pattern: str) -> list[str]:
        """This run's metric names equal to ``pattern`` or matching it as a glob (``eval/*/score``)."""
        return sorted(name for name in self.series if name == pattern or fnmatchcase(name, pattern))


def load_run(path: str | Path) -> Run:
    """Read the run in directory ``path`` (its ``metrics.jsonl``; ``config.yaml`` for the label)."""
    path = Path(path)
    file = path / METRICS_FILE
    if not file.is_file():
        what = "does not exist" if not path.exists() else f"holds no {METRICS_FILE}"
        raise RunMetricsError(f"{path} is not a run directory: it {what} (give a run's output_dir)")
    rows = _read_rows(file)
    if not rows:
        raise RunMetricsError(f"{file} holds no metrics yet")
    return _to_run(path, _run_name(path), rows)


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Read several runs; labels that collide (two runs of one config keep its ``run_name``) get their
    directory added, so every line and row is told apart."""
    runs = [load_run(p) for p in paths]
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{r.label} ({r.path.name})" if labels.count(r.label) > 1 else r.label for r in runs]
    if len(set(labels)) < len(labels):  # the same directory name under different parents
        labels = [str(r.path) for r in runs]
    return [Run(r.path, label, r.series, r.sample_key) for r, label in zip(runs, labels)]


def available_metrics(runs: Iterable[Run]) -> list[str]:
    return sorted({name for run in runs for name in run.series})


def describe_names(names: Sequence[str], limit: int = 40) -> str:
    """A readable list of metric names; long families (``actions/*`` of an agentic run can hold hundreds)
    are collapsed to their prefix so an error message stays short enough to read."""
    if len(names) <= limit:
        return ", ".join(names)
    families: dict[str, list[str]] = {}
    for name in names:
        families.setdefault(name.rsplit("/", 1)[0] if "/" in name else name, []).append(name)
    parts = []
    for prefix, members in families.items():
        parts.extend([f"{prefix}/* ({len(members)} names)"] if len(members) > 10 else members)
    return ", ".join(parts)


def _read_rows(file: Path) -> list[dict]:
    rows = []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the half-written last line of a killed process
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _run_name(path: Path) -> str:
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return path.resolve().name
    name = config.get("run_name") if isinstance(config, dict) else None
    return str(name) if name else path.resolve().name


def _to_run(path: Path, label: str, rows: list[dict]) -> Run:
    # A step logged twice (a file from before runs rewound their metrics on resume) keeps its last record.
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).update(row)
    steps = sorted(by_step)
    start = min(_finite(r.get("time"), math.inf) for r in rows)
    start = 0.0 if math.isinf(start) else start
    sample_key = next((k for k in SAMPLE_KEYS if any(k in r for r in rows)), None)
    samples = _cumulative_samples(steps, by_step, sample_key) if sample_key else None

    columns: dict[str, tuple[list[int], list[float], list[float], list[float]]] = {}
    for index, step in enumerate(steps):
        row = by_step[step]
        seconds = _finite(row.get("time"), start) - start
        for name, value in row.items():
            if name in ("step", "time") or not (value is None or isinstance(value, (int, float))):
                continue
            column = columns.setdefault(name, ([], [], [], []))
            column[0].append(step)
            column[1].append(math.nan if value is None else float(value))
            column[2].append(seconds)
            column[3].append(samples[index] if samples else 0.0)
    series = {
        name: Series(tuple(s), tuple(v), tuple(t), tuple(n) if samples else None)
        for name, (s, v, t, n) in columns.items()
    }
    return Run(path, label, series, sample_key)


def _cumulative_samples(steps: list[int], by_step: dict[int, dict], key: str) -> list[float]:
    """Training samples through each step. With ``log_every`` > 1 only some steps are recorded, so each
    record's count stands for every step since the previous record (batches are fixed-size in practice)."""
    total, previous, out = 0.0, 0, []
    for step in steps:
        count = by_step[step].get(key)
        if isinstance(count, (int, float)) and step > previous:
            total += count * (step - previous)
            previous = step
        out.append(total)
    return out


def _finite(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else default
