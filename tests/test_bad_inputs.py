"""Bad inputs an operator gives ``roll train``: each fails before any pipeline, Ray or model starts, with
exit code 2 and one message that names the key, file or line to fix, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from roll.cli import app

QUICKSTART = "examples/quickstart.yaml"
SFT = "examples/sft.yaml"

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_pipeline(monkeypatch: pytest.MonkeyPatch, repo_root: Path) -> None:
    """Run from the repository root, and make starting a pipeline (and with it Ray and the models) a
    test failure: every input below must be rejected before that."""
    monkeypatch.chdir(repo_root)

    def pipeline_started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pipeline started: the bad input was not caught before the expensive work")

    monkeypatch.setattr("roll.pipelines.run_pipeline", pipeline_started)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def train(config: str, *overrides: str) -> tuple[int, str]:
    result = runner.invoke(app, ["train", config, *overrides])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stderr


def rejected(output_dir: Path, config: str, *overrides: str) -> str:
    """The one-line-per-problem error of a rejected ``roll train`` into ``output_dir``, which must not
    have been created."""
    code, stderr = train(config, f"output_dir={output_dir}", *overrides)
    assert code == 2, stderr
    assert stderr.startswith("error: ") and "Traceback" not in stderr, stderr
    assert not output_dir.exists(), f"something was written into {output_dir}: {list(output_dir.iterdir())}"
    return stderr


BAD_SETTINGS = [
    (
        ["domains={m: {train_path: x.jsonl}}"],
        ["domains.m.train_path: 'x.jsonl' does not exist", "set exactly one"],
    ),
    (
        ["tracking.backends=[console,neptune]"],
        ["tracking.backends", "'neptune'", "console, jsonl, mlflow, tensorboard, wandb"],
    ),
    (["tracking.log_every=0"], ["tracking.log_every must be >= 1 (got 0)"]),
    (["rollout.top_p=-0.5"], ["rollout.top_p must be in (0, 1] (got -0.5)"]),
    (["rollout.top_p=1.5"], ["rollout.top_p must be in (0, 1] (got 1.5)"]),
    (["rollout.top_k=-3"], ["rollout.top_k must be >= 0 (got -3)"]),
    (["ray.call_timeout_s=-1"], ["ray.call_timeout_s must be > 0 (got -1.0)"]),
    (["ray.liveness_timeout_s=-1"], ["ray.liveness_timeout_s must be >= 0"]),
    (["actor.mini_batch_size=0"], ["actor.mini_batch_size must be > 0 (got 0)"]),
    (["model.tiny.hidden_size=100", "model.tiny.num_attention_heads=3"], ["divisible by model.tiny.num"]),
    (["data.max_prompt_length=0"], ["data.max_prompt_length must be > 0"]),
    (["eval.max_prompts=0"], ["eval.max_prompts must be >= 1"]),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), BAD_SETTINGS, ids=[" ".join(overrides) for overrides, _ in BAD_SETTINGS]
)
def test_bad_settings_are_rejected_at_load(tmp_path: Path, overrides: list[str], expected: list[str]) -> None:
    message = rejected(tmp_path / "run", QUICKSTART, *overrides)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message}"


def test_a_device_mapping_on_a_machine_without_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU here, whatever the machine has
    message = rejected(tmp_path / "run", QUICKSTART, "actor.device_mapping=[0]")
    assert "actor.device_mapping: names device 0 but the cluster has no devices" in message
    assert "ray.num_gpus" in message  # the way to run it on CPU anyway


def test_a_device_mapping_beyond_the_visible_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    message = rejected(tmp_path / "run", QUICKSTART, "rollout.device_mapping=[1,2]")
    assert "rollout.device_mapping: names device 2 but the cluster has 2 devices" in message


@pytest.mark.parametrize("setting", ["ray.address", "RAY_ADDRESS"])
def test_a_ray_address_where_nothing_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    overrides = ["ray.address=127.0.0.1:1"] if setting == "ray.address" else []
    if setting == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    message = rejected(tmp_path / "run", QUICKSTART, *overrides)
    assert f"{setting}: nothing answers at 127.0.0.1:1" in message
    assert "ray start --head" in message


def test_a_ray_address_that_is_not_an_address(tmp_path: Path) -> None:
    message = rejected(tmp_path / "run", QUICKSTART, "ray.address=headnode")
    assert "ray.address: 'headnode' is not an address; expected host:port" in message


def test_output_dir_that_is_a_file(tmp_path: Path) -> None:
    existing = tmp_path / "taken"
    existing.write_text("keep me")
    code, stderr = train(QUICKSTART, f"output_dir={existing}")
    assert code == 2 and f"output_dir: '{existing}' is a file, not a directory" in stderr
    assert existing.read_text() == "keep me"


def test_output_dir_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("keep me")
    message = rejected(tmp_path / "taken" / "run", QUICKSTART)
    assert f"cannot be created because '{tmp_path / 'taken'}' is a file" in message


def test_output_dir_that_cannot_be_written(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        parent = Path("/sys")  # root ignores permission bits; a kernel filesystem still refuses
    else:
        parent = tmp_path / "read-only"
        parent.mkdir(mode=0o500)
    message = rejected(parent / "run", QUICKSTART)
    assert f"output_dir: '{parent / 'run'}' cannot be written: '{parent}' refuses new entries" in message


def test_a_data_file_that_is_not_utf8(tmp_path: Path) -> None:
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    message = rejected(tmp_path / "run", QUICKSTART, f"data.train_path={data}")
    assert f"{data}:2: not valid UTF-8 (byte 0xe9 at column 16)" in message


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from roll.rewards import REWARD_FUNCTIONS\n\ndef f(:\n", "user_rewards.py:3: SyntaxError"),
        ("import os\n\nraise RuntimeError('no API key')\n", "user_rewards.py:3: RuntimeError: no API key"),
    ],
    ids=["syntax error", "raises while imported"],
)
def test_a_broken_module_in_imports_names_its_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, expected: str
) -> None:
    (tmp_path / "user_rewards.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)
    code, stderr = train(str(Path(__file__).parents[1] / QUICKSTART), "imports=[user_rewards]")
    assert code == 2, stderr
    assert f"{tmp_path}/{expected}" in stderr and "imports" in stderr
    assert not (tmp_path / "runs").exists()


def test_a_config_path_that_is_a_directory(tmp_path: Path) -> None:
    code, stderr = train(str(tmp_path))
    assert code == 2 and f"config file '{tmp_path}' is a directory, not a YAML file" in stderr


@pytest.mark.parametrize("key", ["data.train_path", "data.eval_path"])
def test_a_data_path_that_is_a_directory_datasets_did_not_save(tmp_path: Path, key: str) -> None:
    message = rejected(tmp_path / "run", QUICKSTART, f"{key}={tmp_path}")
    assert f"{key}: '{tmp_path}' is a directory, but not a dataset saved with Hugging Face" in message


def test_a_data_file_of_an_unknown_format(tmp_path: Path) -> None:
    data = tmp_path / "rows.txt"
    data.write_text("1+1\n")
    message = rejected(tmp_path / "run", QUICKSTART, f"data.train_path={data}")
    assert f"data.train_path: dataset file '{data}' has extension '.txt', which names no" in message
    assert ".jsonl, .json, .parquet, .arrow, .csv" in message


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("config", "overrides", "key"),
    [
        (QUICKSTART, ["sft_warm_start=null"], "rollout.rollout_batch_size=8"),
        (QUICKSTART, ["rollout.rollout_batch_size=4"], "sft_warm_start.batch_size=64"),
        (SFT, [], "train.batch_size=64"),
    ],
)
def test_a_dataset_smaller_than_a_batch_names_the_key(
    tmp_path: Path, config: str, overrides: list[str], key: str
) -> None:
    data = write_rows(
        tmp_path / "small.jsonl", [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(5)]
    )
    message = rejected(tmp_path / "run", config, f"data.train_path={data}", *overrides)
    assert f"has 5 rows, fewer than one batch of {key}" in message
    assert f"lower {key.split('=')[0]} to at most 5" in message


def test_characters_the_tokenizer_does_not_know_are_rejected_with_file_and_line(tmp_path: Path) -> None:
    rows = [{"prompt": "1+2", "answer": "3"}] * 9 + [{"prompt": "1 + 2 = ?", "answer": "3"}]
    data = write_rows(tmp_path / "spaced.jsonl", rows)
    message = rejected(tmp_path / "run", QUICKSTART, f"data.train_path={data}")
    assert f"{data}:10: field 'prompt' has characters the tokenizer does not know (' ', '=', '?')" in message
    assert "model.tiny.alphabet" in message


def test_an_sft_target_the_tokenizer_cannot_write_is_rejected(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "answers.jsonl", [{"prompt": "1+2", "answer": "three"}] * 70)
    message = rejected(tmp_path / "run", SFT, f"data.train_path={data}")
    assert f"{data}:1: field 'answer' has characters the tokenizer does not know" in message


def test_a_prompt_too_long_names_its_line(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1", "answer": "2"}] * 3 + [{}, {"prompt": "1" * 40, "answer": "1"}]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" if r else "\n" for r in rows))  # line 4 is blank
    message = rejected(
        tmp_path / "run", QUICKSTART, f"data.train_path={data}", "rollout.rollout_batch_size=2"
    )
    assert f"{data}:5: the prompt is" in message and "data.max_prompt_length=10" in message


def test_a_directory_the_tiny_model_may_not_replace(tmp_path: Path) -> None:
    foreign = tmp_path / "run" / "tiny_model"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    code, stderr = train(QUICKSTART, f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "refusing to overwrite it" in stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["tiny_model"]


def test_data_errors_stop_the_command_before_ray_is_imported(repo_root: Path, tmp_path: Path) -> None:
    # A fresh interpreter where `import ray` fails: reaching Ray would be an ImportError (exit 1).
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "caf\xe9", "answer": "2"}\n')
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["ray"] = None
        from roll.cli import app
        try:
            app(["train", {QUICKSTART!r}, "output_dir={tmp_path / "run"}", "data.train_path={data}"])
        except SystemExit as e:
            print("EXIT", e.code)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split()[-2:] == ["EXIT", "2"], result.stdout + result.stderr
    assert f"{data}:1: not valid UTF-8" in result.stderr
    assert not (tmp_path / "run").exists()
