"""``roll plot``: runs' metrics overlaid in one PNG, a panel per metric family.

Colour tells the runs apart (the legend above the panels); within a panel that draws several metrics (per-
domain scores, the step-time stages) the line style tells the metrics apart (the panel's own legend), or
the colour when only one run is drawn.
matplotlib is imported inside the functions, on the Agg backend, so this works without a display and
``import roll.plots`` stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from roll.run_metrics import X_AXES, Run, RunMetricsError, available_metrics, describe_names

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Panel:
    """One subplot: ``name`` is what ``--metrics`` calls it; ``patterns`` are metric names or globs, drawn
    in this order (a metric that an earlier pattern matched is not drawn twice)."""

    name: str
    title: str
    patterns: tuple[str, ...]


DEFAULT_PANELS = (
    Panel("reward", "reward (training batch mean)", ("reward/mean",)),
    # The mix over domains first, then each domain's own score (multi-domain runs).
    Panel("eval", "held-out score", ("eval/score", "eval/*/score")),
    Panel("length", "response length (tokens)", ("response/length_mean",)),
    # To the reference (as a loss or in the reward, when a reference is used), then to the old policy.
    Panel("kl", "KL", ("actor/kl", "reward/kl", "actor/approx_kl")),
    Panel("entropy", "entropy", ("actor/entropy",)),
    Panel("clip_frac", "clip fraction", ("actor/clip_frac",)),
    Panel("time", "step time breakdown (s)", ("time/step_s", "time/*_s")),
)
PANELS = {panel.name: panel for panel in DEFAULT_PANELS}
# Evaluation series are not smoothed: they have few points, each already a mean over the held-out set.
UNSMOOTHED_PREFIX = "eval/"
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)))
# A series with this many points or fewer (evaluations, short runs) gets markers, so single points show.
MARKER_MAX_POINTS = 30
X_LABELS = {"step": "step", "samples": "training samples"}


@dataclass
class Plot:
    """The figure and what was left out of it (a panel no run logs, a run without a panel's metric)."""

    figure: Figure
    notes: list[str] = field(default_factory=list)


def resolve_panels(runs: Sequence[Run], requested: Sequence[str] | None) -> tuple[list[Panel], list[str]]:
    """The panels to draw and notes on what is skipped. ``requested``: panel names (``PANELS``), metric
    names or globs; None means ``DEFAULT_PANELS``, whose metrics no run logs are skipped. A requested
    item that matches no run's metrics is an error naming what the runs have."""
    notes: list[str] = []
    panels: list[Panel] = []
    if requested is None:
        for panel in DEFAULT_PANELS:
            if _panel_metrics(runs, panel):
                panels.append(panel)
            else:
                notes.append(f"skipped panel '{panel.name}': no run logs {' or '.join(panel.patterns)}")
        if not panels:
            raise RunMetricsError(
                "the runs log none of the default panels' metrics; choose some with --metrics from: "
                + describe_names(available_metrics(runs))
            )
        return panels, notes
    for item in requested:
        panel = PANELS.get(item, Panel(item, item, (item,)))
        if not _panel_metrics(runs, panel):
            raise RunMetricsError(
                f"no run logs {' or '.join(panel.patterns)}; available metrics: "
                f"{describe_names(available_metrics(runs))} (panels: {', '.join(PANELS)})"
            )
        panels.append(panel)
    return panels, notes


def plot_runs(
    runs: Sequence[Run], metrics: Sequence[str] | None = None, x: str = "step", smooth: int = 1
) -> Plot:
    """Overlay ``runs`` in one figure, a panel per item of ``metrics`` (see ``resolve_panels``), over the
    ``x`` axis (``step``, ``time`` since each run's first record, or cumulative training ``samples``).
    ``smooth``: each point becomes the mean of the finite values among it and the ``smooth - 1`` points
    before it (a trailing moving average; 1 = raw), and the raw line stays as a faint trace."""
    if x not in X_AXES:
        raise RunMetricsError(f"unknown x axis {x!r}; choose one of {', '.join(X_AXES)}")
    if smooth < 1:
        raise RunMetricsError(f"smooth must be >= 1 (a window of points), got {smooth}")
    if x == "samples":
        missing = [run.label for run in runs if run.sample_key is None]
        if missing:
            raise RunMetricsError(
                f"no training-sample count (rollout/samples or sft/samples) in {', '.join(missing)}: runs "
                "of older versions log none; plot them with --x step or --x time"
            )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    panels, notes = resolve_panels(runs, metrics)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.6 * rows + 0.6), squeeze=False)
    plt.close(figure)  # owned by the caller, not pyplot's global list: many plots must not pile up
    # One run: its panels' several metrics differ in colour, which reads better than dashes on dense lines.
    single = len(runs) == 1
    colors = ["0.2"] if single else [f"C{i % 10}" for i in range(len(runs))]
    scale, unit = _time_scale(runs) if x == "time" else (1.0, "")
    for index, panel in enumerate(panels):
        axes = grid[index // columns][index % columns]
        names = _panel_metrics(runs, panel)
        styles = {
            name: {"color": f"C{i % 10}", "linestyle": "-"}
            if single
            else {"linestyle": LINE_STYLES[i % len(LINE_STYLES)]}
            for i, name in enumerate(names)
        }
        for run, color in zip(runs, colors):
            drawn = [name for name in names if name in run.series]
            if not drawn:
                notes.append(f"{run.label}: no {' or '.join(panel.patterns)} for panel '{panel.title}'")
            for name in drawn:
                series = run.series[name]
                xs = [value / scale for value in series.x(x)]
                ys = list(series.values)
                marker = "o" if len(xs) <= MARKER_MAX_POINTS else None
                style = {"color": color, "marker": marker, "markersize": 3, **styles[name]}
                if smooth > 1 and not name.startswith(UNSMOOTHED_PREFIX):
                    axes.plot(xs, ys, alpha=0.2, linewidth=0.8, gid=f"{run.label}|{name}|raw", **style)
                    ys = moving_average(ys, smooth)
                axes.plot(
                    xs, ys, linewidth=1.4, label=f"{run.label} {name}", gid=f"{run.label}|{name}", **style
                )
        axes.set_title(panel.title)
        axes.set_xlabel(X_LABELS.get(x, f"time ({unit})"))
        axes.grid(alpha=0.3)
        if len(names) == 1:  # the title names the family; this says exactly which metric it is
            axes.set_ylabel(names[0], fontsize="small")
        else:
            handles = [Line2D([], [], **{"color": "0.3", **styles[name]}) for name in names]
            axes.legend(handles, names, fontsize="x-small")
    for index in range(len(panels), rows * columns):
        figure.delaxes(grid[index // columns][index % columns])
    run_handles = [Line2D([], [], color=color, linewidth=2) for color in colors]
    figure.legend(run_handles, [run.label for run in runs], loc="upper center", ncol=min(len(runs), 4))
    smoothing = f"; trailing mean over {smooth} points (eval/ unsmoothed)" if smooth > 1 else ""
    figure.text(0.5, 0.005, f"x: {x}{smoothing}", ha="center", va="bottom", fontsize="small", color="0.4")
    figure.tight_layout(rect=(0, 0.03, 1, 1 - 0.5 / figure.get_figheight()))
    return Plot(figure, notes)


def save_plot(plot: Plot, path: str | Path) -> Path:
    """Write ``plot`` as a PNG at ``path`` (parent directories made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot.figure.savefig(path, format="png", dpi=100)
    return path


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Each point: the mean of the finite values among it and the ``window - 1`` before it. A NaN point
    stays NaN, so a diverged step still shows as a gap."""
    out = []
    for i, value in enumerate(values):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if math.isfinite(value) else math.nan)
    return out


def _panel_metrics(runs: Sequence[Run], panel: Panel) -> list[str]:
    """The metric names the panel draws, over all runs, in pattern order."""
    names: list[str] = []
    for pattern in panel.patterns:
        for name in sorted({n for run in runs for n in run.matching(pattern)}):
            if name not in names:
                names.append(name)
    return names


def _time_scale(runs: Sequence[Run]) -> tuple[float, str]:
    """One unit for every run (they share the axis), chosen by the longest run."""
    longest = max((s.seconds[-1] for run in runs for s in run.series.values() if s.seconds), default=0.0)
    if longest > 3 * 3600:
        return 3600.0, "h"
    if longest > 600:
        return 60.0, "min"
    return 1.0, "s"
