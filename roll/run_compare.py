"""``roll compare``: each run's final and best value of one metric, and when it first reached a threshold."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from roll.run_metrics import Run, RunMetricsError, Series, available_metrics, describe_names

GOALS = ("max", "min")


@dataclass(frozen=True)
class Point:
    """One logged value and where it was logged: step, seconds since the run's first record, samples."""

    value: float
    step: int
    seconds: float
    samples: float | None


@dataclass(frozen=True)
class Summary:
    """``final``: the last logged value (NaN included: a run that ended diverged should say so). ``best``:
    the highest (``goal="max"``) or lowest finite value, the first one on ties; None if none is finite.
    ``reached``: the first value at or beyond the threshold, None if never (or no threshold)."""

    final: Point
    best: Point | None
    reached: Point | None


def summarize(series: Series, goal: str = "max", threshold: float | None = None) -> Summary:
    if goal not in GOALS:
        raise RunMetricsError(f"unknown goal {goal!r}; choose one of {', '.join(GOALS)}")
    points = [
        Point(v, s, t, None if series.samples is None else series.samples[i])
        for i, (s, v, t) in enumerate(zip(series.steps, series.values, series.seconds))
    ]
    finite = [p for p in points if math.isfinite(p.value)]
    sign = 1.0 if goal == "max" else -1.0
    best = max(finite, key=lambda p: sign * p.value) if finite else None  # max keeps the first of ties
    reached = None
    if threshold is not None:
        reached = next((p for p in finite if sign * (p.value - threshold) >= 0), None)
    return Summary(points[-1], best, reached)


def compare_table(
    runs: Sequence[Run], metric: str, goal: str = "max", threshold: float | None = None
) -> Table:
    """The table ``roll compare`` prints; an error names the available metrics when no run has ``metric``."""
    if not any(metric in run.series for run in runs):
        raise RunMetricsError(
            f"no run logs {metric!r}; available metrics: {describe_names(available_metrics(runs))}"
        )
    word = ">=" if goal == "max" else "<="
    table = Table(title=f"{metric} ({'higher' if goal == 'max' else 'lower'} is better)")
    table.add_column("run")
    table.add_column("steps", justify="right")
    table.add_column("final (step)", justify="right")
    table.add_column("best (step)", justify="right")
    if threshold is not None:
        table.add_column(f"first {word} {threshold:g}: step, time, samples", justify="right")
    for run in runs:
        cells = [run.label, str(run.last_step)]
        if metric not in run.series:
            table.add_row(*cells, "not logged by this run", "", *([""] if threshold is not None else []))
            continue
        summary = summarize(run.series[metric], goal, threshold)
        cells.append(f"{_number(summary.final.value)} ({summary.final.step})")
        cells.append(f"{_number(summary.best.value)} ({summary.best.step})" if summary.best else "no value")
        if threshold is not None:
            cells.append(_reached(summary.reached, threshold, word, run.last_step))
        table.add_row(*cells)
    return table


def _reached(point: Point | None, threshold: float, word: str, last_step: int) -> str:
    if point is None:
        return f"never {word} {threshold:g} in {last_step} steps"
    samples = "" if point.samples is None else f", {point.samples:,.0f}"
    return f"{point.step}, {format_seconds(point.seconds)}{samples}"


def format_seconds(seconds: float) -> str:
    """``42.0 s``, ``3 min 05 s`` or ``2 h 07 min``: run times span seconds to days."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _number(value: float) -> str:
    return f"{value:.4g}"
