"""The ``roll`` command: ``roll train CONFIG [key=value ...]`` and ``roll config CONFIG [key=value ...]``.

Config loading and validation come first and import neither torch nor Ray, so a typo is rejected at once.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
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
) -> None:
    """Run the pipeline a config names (rlvr, sft)."""
    from roll.utils import signals

    cfg = _load(config, overrides or [])
    ray_started_here = not _ray_running()
    with signals.stop_on_signals():
        try:
            _run(cfg)
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


def _run(cfg) -> None:
    from roll.config import ConfigError
    from roll.data.dataset import DatasetError
    from roll.pipelines.preflight import preflight

    # Everything that can be checked is checked before Ray starts or anything is written.
    try:
        inputs = preflight(cfg)
    except (ConfigError, DatasetError) as e:
        _fail(e, 2)
    from roll.distributed.cluster import WorkerError
    from roll.distributed.weight_sync import WeightSyncError
    from roll.pipelines import run_pipeline

    try:
        run_pipeline(cfg, inputs)
    except (ConfigError, DatasetError) as e:
        _fail(e, 2)
    except (WorkerError, WeightSyncError) as e:
        # The remote traceback is the useful part; the driver's own stack adds nothing.
        _fail(e, 1)


def _stop_line(cfg, signum: int, activity: str) -> str:
    kept = f"; the finished steps' metrics are in {cfg.output_dir}" if Path(cfg.output_dir).is_dir() else ""
    return (
        f"roll: stopped by {signal.Signals(signum).name} during {activity}. Nothing was saved (ROLL does "
        f"not write checkpoints yet; the final model is saved only when a run ends){kept}. "
        "Workers released."
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


if __name__ == "__main__":
    app()
