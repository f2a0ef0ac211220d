"""``roll plot`` and ``roll compare`` on real runs' metrics (tests/data/plot_runs, see its README.md):
the quickstart (3000 steps, every 10th recorded) and a shorter quickstart (300 steps, another seed,
every step recorded). Expected values are computed from the files here, independently of
``roll.run_metrics``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from roll.cli import app
from roll.plots import DEFAULT_PANELS, moving_average, plot_runs, save_plot
from roll.run_compare import summarize
from roll.run_metrics import RunMetricsError, load_run, load_runs

RUNS = Path(__file__).resolve().parent / "data" / "plot_runs"
LONG = RUNS / "quickstart"
SHORT = RUNS / "quickstart_seed1_300"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

runner = CliRunner()


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def column(run: Path, metric: str) -> tuple[list[int], list[float], list[float]]:
    """Steps, values and seconds since the first record of ``metric`` in the run's file."""
    records = rows(run)
    start = min(r["time"] for r in records)
    kept = [r for r in records if metric in r]
    return (
        [r["step"] for r in kept],
        [math.nan if r[metric] is None else r[metric] for r in kept],
        [r["time"] - start for r in kept],
    )


def lines(plot, title: str) -> dict[str, object]:
    """The panel titled ``title``: its lines by gid (``run|metric`` or ``run|metric|raw``)."""
    (axes,) = [a for a in plot.figure.axes if a.get_title() == title]
    return {line.get_gid(): line for line in axes.get_lines()}


@pytest.fixture(scope="module")
def runs():
    return load_runs([LONG, SHORT])


def test_data_are_the_runs_described() -> None:
    long_steps, short_steps = [r["step"] for r in rows(LONG)], [r["step"] for r in rows(SHORT)]
    assert long_steps[0] == short_steps[0] == 0  # the evaluation before training
    assert long_steps[-1] == 3000 and short_steps[-1] == 300


def test_default_panels_and_a_valid_png(runs, tmp_path: Path) -> None:
    plot = plot_runs(runs)
    assert [a.get_title() for a in plot.figure.axes] == [p.title for p in DEFAULT_PANELS]
    assert plot.notes == []
    path = save_plot(plot, tmp_path / "sub" / "plot.png")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == tuple(round(v) for v in plot.figure.get_size_inches() * 100)


def test_metrics_choose_the_panels(runs) -> None:
    plot = plot_runs(runs, ["eval", "actor/grad_norm", "time/*_s"])
    assert [a.get_title() for a in plot.figure.axes] == ["held-out score", "actor/grad_norm", "time/*_s"]
    assert set(lines(plot, "time/*_s")) == {
        f"{run.label}|time/{stage}_s"
        for run in runs
        for stage in ("rollout", "logprobs", "train", "sync", "step")
    }


def test_runs_of_different_lengths_each_over_their_own_steps(runs) -> None:
    drawn = lines(plot_runs(runs, ["reward", "eval"]), "reward (training batch mean)")
    for run, path in zip(runs, (LONG, SHORT)):
        steps, values, _ = column(path, "reward/mean")
        line = drawn[f"{run.label}|reward/mean"]
        assert list(line.get_xdata()) == steps
        assert list(line.get_ydata()) == pytest.approx(values, nan_ok=True)
    assert drawn["quickstart|reward/mean"].get_xdata()[-1] == 3000
    assert drawn["quickstart_seed1_300|reward/mean"].get_xdata()[-1] == 300


def test_x_time_is_seconds_since_the_first_record(runs) -> None:
    plot = plot_runs(runs, ["eval"], x="time")
    (axes,) = plot.figure.axes
    assert axes.get_xlabel() == "time (min)"  # the long run took over ten minutes
    drawn = lines(plot, "held-out score")
    for run, path in zip(runs, (LONG, SHORT)):
        _, values, seconds = column(path, "eval/score")
        line = drawn[f"{run.label}|eval/score"]
        assert list(line.get_xdata()) == pytest.approx([s / 60 for s in seconds])
        assert list(line.get_ydata()) == pytest.approx(values)


def test_x_samples_counts_the_training_samples(runs) -> None:
    # 8 prompts x 8 samples a step; the long run records every 10th step, which stands for the 10.
    drawn = lines(plot_runs(runs, ["reward"], x="samples"), "reward (training batch mean)")
    for run, path in zip(runs, (LONG, SHORT)):
        steps, _, _ = column(path, "reward/mean")
        assert {r["rollout/samples"] for r in rows(path) if "rollout/samples" in r} == {64}
        assert list(drawn[f"{run.label}|reward/mean"].get_xdata()) == [64.0 * s for s in steps]


def test_smoothing_is_a_trailing_mean_and_leaves_eval_raw(runs) -> None:
    plot = plot_runs(runs[1:], ["reward", "eval"], smooth=5)
    drawn = lines(plot, "reward (training batch mean)")
    _, values, _ = column(SHORT, "reward/mean")
    expected = [
        sum(values[max(0, i - 4) : i + 1]) / len(values[max(0, i - 4) : i + 1]) for i in range(len(values))
    ]
    assert list(drawn["quickstart_seed1_300|reward/mean"].get_ydata()) == pytest.approx(expected)
    assert list(drawn["quickstart_seed1_300|reward/mean|raw"].get_ydata()) == pytest.approx(values)
    assert expected != pytest.approx(values)
    evals = lines(plot, "held-out score")
    assert set(evals) == {"quickstart_seed1_300|eval/score"}
    assert list(evals["quickstart_seed1_300|eval/score"].get_ydata()) == column(SHORT, "eval/score")[1]


def test_moving_average_skips_nan_and_keeps_nan_points() -> None:
    assert moving_average([1.0, math.nan, 3.0, 5.0], 2) == pytest.approx(
        [1.0, math.nan, 3.0, 4.0], nan_ok=True
    )


def test_compare_numbers_match_the_file(runs) -> None:
    for run, path in zip(runs, (LONG, SHORT)):
        steps, values, seconds = column(path, "eval/score")
        summary = summarize(run.series["eval/score"], threshold=0.5)
        assert (summary.final.step, summary.final.value) == (steps[-1], values[-1])
        best = max(values)
        assert (summary.best.step, summary.best.value) == (steps[values.index(best)], best)
        first = next((i for i, v in enumerate(values) if v >= 0.5), None)
        if first is None:
            assert summary.reached is None
        else:
            assert (summary.reached.step, summary.reached.seconds) == (
                steps[first],
                pytest.approx(seconds[first]),
            )
            assert summary.reached.samples == 64 * steps[first]
    lowest = summarize(runs[0].series["eval/score"], goal="min")
    assert lowest.best.value == min(column(LONG, "eval/score")[1])


def test_cli_compare_table_and_a_threshold_never_reached() -> None:
    result = runner.invoke(
        app, ["compare", str(LONG), str(SHORT), "--metric", "eval/score", "--threshold", "0.5"]
    )
    assert result.exit_code == 0, result.output
    steps, values, _ = column(LONG, "eval/score")
    assert f"{values[-1]:.4g} ({steps[-1]})" in result.stdout
    assert "quickstart_seed1_300" in result.stdout
    result = runner.invoke(app, ["compare", str(LONG), str(SHORT), "--threshold", "2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("never >= 2") == 2


def test_cli_plot_writes_the_png(tmp_path: Path) -> None:
    out = tmp_path / "both.png"
    result = runner.invoke(
        app, ["plot", str(LONG), str(SHORT), "--out", str(out), "--metrics", "reward,kl", "--smooth", "3"]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_cli_plot_default_path_is_in_the_first_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(SHORT, run)
    result = runner.invoke(app, ["plot", str(run), "--x", "time"])
    assert result.exit_code == 0, result.output
    assert (run / "plot.png").read_bytes()[:8] == PNG_SIGNATURE


def test_errors_name_the_problem(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plot", str(LONG), str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "missing is not a run directory" in result.stderr
    result = runner.invoke(app, ["compare", str(tmp_path)])  # exists, but holds no metrics.jsonl
    assert result.exit_code == 2 and "holds no metrics.jsonl" in result.stderr
    result = runner.invoke(app, ["plot", str(LONG), "--metrics", "reward,actor/klx"])
    assert result.exit_code == 2
    assert "no run logs actor/klx" in result.stderr and "actor/approx_kl" in result.stderr
    result = runner.invoke(app, ["compare", str(LONG), "--metric", "eval/scor"])
    assert result.exit_code == 2 and "eval/score" in result.stderr
    result = runner.invoke(app, ["plot", str(LONG), "--x", "tokens"])
    assert result.exit_code == 2 and "step, time, samples" in result.stderr


def write_run(path: Path, records: list[dict], run_name: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if run_name:
        (path / "config.yaml").write_text(f"run_name: {run_name}\n")
    return path


def test_missing_panels_are_skipped_with_a_note(tmp_path: Path, runs) -> None:
    # An SFT run: its own metrics, an evaluation, step times; no reward, KL, entropy or clip fraction.
    sft = write_run(
        tmp_path / "sft",
        [
            {"step": 0, "time": 10.0, "eval/score": 0.1},
            {"step": 1, "time": 11.0, "sft/loss": 2.0, "sft/samples": 32, "time/step_s": 1.0},
            {
                "step": 2,
                "time": 12.0,
                "sft/loss": 1.5,
                "sft/samples": 32,
                "time/step_s": 1.0,
                "eval/score": 0.3,
            },
        ],
    )
    plot = plot_runs([load_run(sft)])
    assert [a.get_title() for a in plot.figure.axes] == ["held-out score", "step time breakdown (s)"]
    assert any("skipped panel 'kl'" in note for note in plot.notes)
    assert list(
        lines(plot_runs([load_run(sft)], ["eval"], x="samples"), "held-out score")[
            "sft|eval/score"
        ].get_xdata()
    ) == [0, 64]
    # Overlaid with an RL run, the panels are drawn for it, and the SFT run's absence is noted.
    both = plot_runs([load_run(sft), *runs], ["reward"])
    assert any(note.startswith("sft: no reward/mean") for note in both.notes)
    result = runner.invoke(app, ["plot", str(sft), "--out", str(tmp_path / "sft.png")])
    assert result.exit_code == 0 and "note: skipped panel 'reward'" in result.stderr


def test_null_values_half_written_lines_and_colliding_labels(tmp_path: Path) -> None:
    a = write_run(
        tmp_path / "a",
        [{"step": 0, "time": 5.0, "reward/mean": None}, {"step": 1, "time": 6.0, "reward/mean": 1.0}],
        "same",
    )
    with (a / "metrics.jsonl").open("a") as file:
        file.write('{"step": 2, "time": 7.0, "rew')  # a process killed mid-line
    b = write_run(tmp_path / "b", [{"step": 0, "time": 1.0, "reward/mean": 0.5}], "same")
    run_a, run_b = load_runs([a, b])
    assert (run_a.label, run_b.label) == ("same (a)", "same (b)")
    series = run_a.series["reward/mean"]
    assert series.steps == (0, 1) and math.isnan(series.values[0]) and series.seconds == (0.0, 1.0)
    assert summarize(series).best.value == 1.0
    with pytest.raises(RunMetricsError, match="no training-sample count"):
        plot_runs([run_a], x="samples")
    # Without a config.yaml the directory names the run.
    assert load_run(write_run(tmp_path / "c", [{"step": 0, "time": 1.0, "x": 1}])).label == "c"
