"""The ``roll`` command: ``roll train CONFIG [key=value ...]`` and ``roll config CONFIG [key=value ...]``.

Config loading and validation come first and import neither torch nor Ray, so a typo is rejected at once.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="ROLL: reinforcement learning for LLMs.",
    # Locals of a training loop hold tensors and whole batches: printing them buries the actual error.
    pretty_exceptions_show_locals=False,
)


def _load(config: str, overrides: list[str]):
    from roll.config import ConfigError, load_config
    from roll.data.dataset import DatasetError

    try:
        return load_config(config, overrides)
    except (ConfigError, DatasetError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None


@app.command()
def train(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. actor.lr=1e-5."),
) -> None:
    """Run the pipeline a config names (rlvr, sft)."""
    cfg = _load(config, overrides or [])
    from roll.data.dataset import DatasetError
    from roll.distributed.cluster import WorkerError
    from roll.pipelines import run_pipeline

    try:
        run_pipeline(cfg)
    except DatasetError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    except WorkerError as e:
        # The remote traceback is the useful part; the driver's own stack adds nothing.
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None


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
