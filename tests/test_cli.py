"""The ``roll`` command line: ``roll config`` prints the resolved config; bad configs fail fast (exit 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from roll.cli import app
from roll.config.fields import field_docs
from roll.config.rlvr import RLVRConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "examples/quickstart.yaml"

runner = CliRunner()


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Config paths (examples/data/...) are relative to the working directory: run from the repo root."""
    monkeypatch.chdir(REPO_ROOT)


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m roll.cli ARGS`` in a fresh interpreter, from the repo root."""
    return subprocess.run(
        [sys.executable, "-m", "roll.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def run_app_in_subprocess(*args: str) -> tuple[list[str], str]:
    """Call ``roll.cli.app(ARGS)`` in a fresh interpreter; return its last stdout line's fields and stderr.

    The last line is ``EXIT <code> <ray imported> <torch imported>``, printed after catching SystemExit.
    """
    code = textwrap.dedent(
        f"""
        import sys
        from roll.cli import app
        try:
            app({list(args)!r})
            code = 0
        except SystemExit as e:
            code = e.code
        print("EXIT", code, "ray" in sys.modules, "torch" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1].split()
    assert last[0] == "EXIT", result.stdout
    return last[1:], result.stderr


def test_config_prints_resolved_yaml_with_override() -> None:
    result = runner.invoke(app, ["config", QUICKSTART, "actor.lr=2e-5"])
    assert result.exit_code == 0, result.output
    assert "pipeline: rlvr" in result.stdout
    assert "  lr: 2.0e-05" in result.stdout
    assert result.stderr == ""
    # The printed text is plain YAML with the override applied and defaults filled in.
    data = yaml.safe_load(result.stdout)
    assert data["actor"]["lr"] == pytest.approx(2e-5)
    assert data["actor"]["lr_scheduler"] == "linear"
    assert data["rollout"]["top_p"] == 1.0
    assert data["ray"]["address"] is None


def test_config_in_process_several_overrides() -> None:
    result = runner.invoke(
        app, ["config", QUICKSTART, "rollout.num_return_sequences=4", "tracking.backends=[jsonl]"]
    )
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(result.stdout)
    assert data["rollout"]["num_return_sequences"] == 4
    assert data["tracking"]["backends"] == ["jsonl"]
    assert "#" not in result.stdout  # no docs unless asked


def test_config_docs_annotates_keys() -> None:
    result = runner.invoke(app, ["config", QUICKSTART, "--docs"])
    assert result.exit_code == 0, result.output
    docs = field_docs(RLVRConfig)
    assert f"# {docs['actor.lr']}" in result.stdout
    assert f"steps: 3000  # {docs['steps']}" in result.stdout
    assert f"# {docs['rollout.num_return_sequences']}" in result.stdout
    assert f"# {docs['model.tiny.max_position_embeddings']}" in result.stdout


@pytest.mark.parametrize("command", ["config", "train"])
def test_mistyped_key_exits_2_with_suggestion(command: str) -> None:
    result = runner.invoke(app, [command, QUICKSTART, "actor.lrr=1e-5"])
    assert result.exit_code == 2
    assert "actor.lrr" in result.stderr
    assert "Did you mean 'lr'" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["config", "train"])
def test_mistyped_key_fails_before_torch_or_ray(command: str) -> None:
    (code, ray_imported, torch_imported), stderr = run_app_in_subprocess(command, QUICKSTART, "stepz=3")
    assert code == "2"
    assert "stepz" in stderr and "Did you mean 'steps'" in stderr
    assert ray_imported == "False"
    assert torch_imported == "False"


def test_train_invalid_combination_fails_before_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    # With ``import ray`` made impossible, reaching Ray would end in an ImportError (exit 1), not exit 2.
    monkeypatch.setitem(sys.modules, "ray", None)
    result = runner.invoke(app, ["train", QUICKSTART, "rollout.world_size=3"])
    assert result.exit_code == 2, result.output
    assert "rollout.rollout_batch_size (8) must be divisible by rollout.world_size (3)" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_train_bad_override_syntax_exits_2() -> None:
    result = runner.invoke(app, ["train", QUICKSTART, "actor.lr"])
    assert result.exit_code == 2
    assert "key=value" in result.stderr


def test_missing_config_file_exits_2() -> None:
    result = runner.invoke(app, ["config", "no/such/config.yaml"])
    assert result.exit_code == 2
    assert "no/such/config.yaml" in result.stderr and "does not exist" in result.stderr


def test_mistyped_key_via_module_exits_2() -> None:
    result = run_module("config", QUICKSTART, "actor.lr_scheduler=cosin")
    assert result.returncode == 2
    assert "actor.lr_scheduler" in result.stderr and "'cosine'" in result.stderr
    assert result.stdout == ""


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "train" in result.stdout
    assert "config" in result.stdout


def test_config_help_mentions_docs_flag() -> None:
    result = runner.invoke(app, ["config", "--help"])
    assert result.exit_code == 0
    assert "--docs" in result.stdout
