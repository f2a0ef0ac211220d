"""W&B and MLflow trackers, against the real libraries with no network: W&B offline (read back from the
files it wrote), MLflow with a SQLite store in tmp_path (read back through ``MlflowClient``).

Each runs a run the way the run loop does: steps with sample tables, a checkpoint, an in-job restart from
it (``tracker.rewind``) and a resume in a new tracker from the checkpoint's ``tracker.json``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import wandb_records
from rich.console import Console

from roll.config import ConfigError, load_config
from roll.config.common import TrackingConfig
from roll.pipelines.common import open_tracker, save_run_checkpoint
from roll.trackers.mlflow_tracker import flatten_config, kept_points, mlflow_name
from roll.trackers.wandb_tracker import SAMPLES_KEY
from roll.tracking import TRACKER_BACKENDS, TRACKER_STATE_FILE, Tracker, TrackerResume, read_tracker_state
from roll.utils.extras import import_extra

QUICKSTART = "examples/quickstart.yaml"
pytestmark = pytest.mark.usefixtures("at_repo_root")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No network and nothing written outside tmp_path: W&B offline, MLflow's telemetry off, and every
    home, cache and config directory the two libraries write to inside tmp_path."""
    home = tmp_path / "home"
    for name in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "WANDB_CACHE_DIR",
                 "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):  # fmt: skip
        monkeypatch.setenv(name, str(home / name.lower()))
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # No system-metrics sampler and no environment probing (git, pip): faster, and nothing to leak.
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")
    monkeypatch.setenv("WANDB__DISABLE_META", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    return tmp_path


@pytest.fixture
def wandb_offline(offline: Path) -> Iterator[Path]:
    yield offline
    import wandb

    # W&B keeps one service process per Python process, set up from the environment of its first run:
    # end it with this test's environment.
    wandb.teardown()


def samples(step: int, attempt: str) -> list[dict[str, Any]]:
    return [{"prompt": f"{step}+1=", "response": attempt, "reward": 1.0, "response_length": len(attempt)}]


# The losses a run_with_restarts run ends with after step 3: the resumed process's.
AFTER = [(4, 104), (5, 105), (6, 106)]


def run_with_restarts(cfg: Any) -> Path:
    """Steps 0-5 with a checkpoint after step 3; an in-job restart from it that gets to step 4 again; then
    a resumed process from the checkpoint that runs steps 4-6. Losses: the step, then 40 + step for the
    restart, then 100 + step for the resumed run. Returns the checkpoint."""
    with open_tracker(cfg, 6) as tracker:
        for step in range(6):
            tracker.log(step, {"loss": float(step)})
            tracker.log_samples(step, samples(step, "first"))
            if step == 3:
                checkpoint = save_run_checkpoint(cfg, step, {}, dict, tracker)
        tracker.rewind(3)  # what RunLoop._restart does after loading the checkpoint
        tracker.log(4, {"loss": 44.0})
        tracker.log_samples(4, samples(4, "second"))
    with open_tracker(cfg, 6, checkpoint) as tracker:
        tracker.rewind(3)  # what begin_run does after loading the checkpoint
        for step in (4, 5, 6):
            tracker.log(step, {"loss": 100.0 + step})
            tracker.log_samples(step, samples(step, "third"))
    return checkpoint


def quickstart(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *overrides: str) -> Any:
    """The quickstart config writing to tmp_path, which then is the working directory, so that whatever a
    library writes relative to it (MLflow's default artifact root ./mlruns) lands there too."""
    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path / 'run'}", "tracking.samples_every=2", *overrides])
    monkeypatch.chdir(tmp_path)
    return cfg


def test_wandb_offline_logs_config_metrics_and_tables_and_resumes_the_same_run(
    monkeypatch: pytest.MonkeyPatch, wandb_offline: Path
) -> None:
    cfg = quickstart(
        monkeypatch,
        wandb_offline,
        "tracking.backends=[jsonl,wandb]",
        "tracking.wandb.mode=offline",
        "tracking.wandb.project=roll-tests",
        "tracking.wandb.tags=[ci]",
    )
    checkpoint = run_with_restarts(cfg)
    import wandb

    # finish() can return before W&B's service wrote the run's last records; its shutdown waits for them.
    wandb.teardown()

    run_id = json.loads((checkpoint / TRACKER_STATE_FILE).read_text())["backends"]["wandb"]["run_id"]
    segments = wandb_records.segments(wandb_offline / "run" / "wandb")
    # One W&B run: its first start, the in-job restart and the resumed process, each rewound to step 3.
    assert [(s.run_id, s.rewound_to) for s in segments] == [(run_id, None), (run_id, 3), (run_id, 3)]
    assert {(s.project, tuple(s.tags)) for s in segments} == {("roll-tests", ("ci",))}
    config = segments[0].config
    assert config["actor"]["lr"] == cfg.actor.lr and config["tracking"]["wandb"]["mode"] == "offline"
    assert config["run_name"] == cfg.run_name

    # The first start logged steps 0-5 at their own step; the rewinds leave each step once, the latest.
    assert [row["loss"] for row in segments[0].rows.values()] == [0, 1, 2, 3, 4, 5]
    rows = wandb_records.history(segments)
    assert [(step, row["loss"]) for step, row in rows.items()] == [(0, 0), (1, 1), (2, 2), (3, 3), *AFTER]

    # Sample tables every samples_every (2) steps, with the sample's columns.
    first = wandb_records.table(segments[0], 2, SAMPLES_KEY)
    assert first["columns"] == ["prompt", "response", "reward", "response_length"]
    assert first["data"] == [["2+1=", "first", 1.0, 5]]
    assert [step for step, row in rows.items() if f"{SAMPLES_KEY}/path" in row] == [0, 2, 4, 6]
    assert wandb_records.table(segments[2], 6, SAMPLES_KEY)["data"] == [["6+1=", "third", 1.0, 5]]


def test_mlflow_local_store_logs_config_metrics_and_tables_and_resumes_the_same_run(
    monkeypatch: pytest.MonkeyPatch, offline: Path
) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{offline / 'mlflow.db'}"
    # MlflowClient.load_table searches runs through MLflow's global tracking URI, not the client's.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = quickstart(
        monkeypatch,
        offline,
        "tracking.backends=[jsonl,mlflow]",
        f"tracking.mlflow.tracking_uri={uri}",
        "tracking.mlflow.experiment=roll-tests",
    )
    run_with_restarts(cfg)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("roll-tests")
    [run] = client.search_runs([experiment.experiment_id])  # one run, continued by the restarts
    run_id = run.info.run_id
    assert (run.info.run_name, run.info.status) == (cfg.run_name, "FINISHED")
    assert run.data.params["actor.lr"] == json.dumps(cfg.actor.lr)
    assert run.data.params["tracking.mlflow.experiment"] == "roll-tests"
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(offline))).read_text())
    assert config == json.loads(json.dumps(dataclasses.asdict(cfg), default=str))

    # MLflow keeps every point; the rewinds in roll.rewinds tell the abandoned ones apart.
    history = client.get_metric_history(run_id, "loss")
    assert sorted((p.step, p.value) for p in history) == [
        (0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (4, 44), (4, 104), (5, 5), (5, 105), (6, 106)
    ]  # fmt: skip
    rewinds = json.loads(run.data.tags["roll.rewinds"])
    assert [rewind["step"] for rewind in rewinds] == [3, 3]
    kept = kept_points(history, rewinds)
    assert sorted((p.step, p.value) for p in kept) == [(0, 0), (1, 1), (2, 2), (3, 3), *AFTER]

    # The samples table lost its rows after each rewind's step.
    table = client.load_table(experiment.experiment_id, "samples.json", run_ids=[run_id])
    assert list(table.columns[:3]) == ["step", "prompt", "response"]
    assert list(zip(table["step"], table["response"], strict=True)) == [
        (0, "first"), (2, "first"), (4, "third"), (6, "third")
    ]  # fmt: skip


class FakeRun:
    def __init__(self, run_id: str, starting_step: int) -> None:
        self.id, self.starting_step = run_id, starting_step
        self.logged: list[int] = []
        self.finished = False

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append(step)

    def finish(self) -> None:
        self.finished = True


class FakeWandb:
    """``wandb`` as far as the backend uses it, with a server that holds steps up to ``held`` of run abc and
    refuses rewinds (as a self-hosted W&B server does)."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.inits: list[dict[str, Any]] = []
        self.runs: list[FakeRun] = []

    def init(self, **kwargs: Any) -> FakeRun:
        self.inits.append(kwargs)
        if "resume_from" in kwargs:
            raise RuntimeError("rewind is not enabled for this server")
        resumed = kwargs.get("id") is not None
        self.runs.append(FakeRun(kwargs.get("id") or "abc", self.held + 1 if resumed else 0))
        return self.runs[-1]

    @staticmethod
    def Table(columns: list[str], data: list[list[Any]]) -> tuple:  # noqa: N802 - wandb's name
        return (columns, data)


def fake_tracker(
    monkeypatch: pytest.MonkeyPatch, fake: FakeWandb, rewind: bool, resume: TrackerResume | None
):
    import roll.trackers.wandb_tracker as module

    monkeypatch.setattr(module, "import_extra", lambda name, extra: fake)
    options = TrackingConfig(backends=["wandb"])
    options.wandb.rewind = rewind
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, width=200)
    tracker = Tracker(Path("unused"), "demo", 10, ["wandb"], options=options, resume=resume, console=console)
    return tracker, buffer


def test_wandb_refused_rewind_continues_the_run_and_skips_the_steps_it_holds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    fake = FakeWandb(held=5)
    resume = TrackerResume(3, {"wandb": {"run_id": "abc"}})
    tracker, output = fake_tracker(monkeypatch, fake, rewind=True, resume=resume)
    with tracker:
        for step in range(4, 8):
            tracker.log(step, {"loss": 1.0})
    assert fake.inits[0]["resume_from"] == "abc?_step=3"
    assert (fake.inits[1]["id"], fake.inits[1]["resume"]) == ("abc", "allow")
    assert fake.runs[0].logged == [6, 7]  # W&B holds 4 and 5 already and would drop them
    text = output.getvalue()
    assert "could not rewind run abc to step 3" in text
    assert text.count("already holds steps up to 5") == 1


def test_wandb_without_rewind_an_in_job_restart_skips_what_the_run_logged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    fake = FakeWandb(held=-1)
    tracker, _ = fake_tracker(monkeypatch, fake, rewind=False, resume=None)
    with tracker:
        for step in range(6):
            tracker.log(step, {"loss": 1.0})
        tracker.rewind(3)
        for step in range(4, 8):
            tracker.log(step, {"loss": 2.0})
        assert tracker.backends[0].state() == {"run_id": "abc"}
    assert len(fake.inits) == 1 and "resume_from" not in fake.inits[0]
    assert fake.runs[0].logged == [0, 1, 2, 3, 4, 5, 6, 7]
    assert fake.runs[0].finished


def test_backends_are_registered_with_their_extras() -> None:
    assert TRACKER_BACKENDS.traits("wandb") == {"extra": "wandb"}
    assert TRACKER_BACKENDS.traits("mlflow") == {"extra": "mlflow"}
    help_text = TrackingConfig.__dataclass_fields__["backends"].metadata["help"]
    assert "wandb" in help_text and "mlflow" in help_text


def test_validation_finds_the_extras_without_importing_them(repo_root: Path) -> None:
    code = (
        "import sys\n"
        "from roll.config.common import TrackingConfig\n"
        "from roll.config.validation import check_tracking\n"
        "assert check_tracking(TrackingConfig(backends=['wandb', 'mlflow'])) == []\n"
        "assert not {'wandb', 'mlflow'} & set(sys.modules), 'imported at load'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)


def test_a_missing_extra_is_refused_at_load_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import roll.utils.extras as extras

    monkeypatch.setattr(extras, "is_installed", lambda module: module != "wandb")
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["tracking.backends=[console,wandb,mlflow]"])
    message = str(info.value)
    assert "tracking.backends: 'wandb' needs the wandb package: pip install 'roll-rl[wandb]'" in message
    assert "mlflow" not in message


def test_an_mlflow_file_store_is_refused_at_load_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is true: refused at load, in one line."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["tracking.backends=[console,mlflow]"])
    assert f"MLFLOW_TRACKING_URI: 'file://{tmp_path}/mlruns' is an MLflow file store" in str(info.value)
    assert "sqlite:///mlflow.db" in str(info.value) and "MLFLOW_ALLOW_FILE_STORE=true" in str(info.value)
    with pytest.raises(ConfigError, match="tracking.mlflow.tracking_uri: 'mlruns' is an MLflow file store"):
        load_config(QUICKSTART, ["tracking.backends=[mlflow]", "tracking.mlflow.tracking_uri=mlruns"])
    # A database store, or the opt-out, loads.
    load_config(
        QUICKSTART, ["tracking.backends=[mlflow]", f"tracking.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db"]
    )
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    load_config(QUICKSTART, ["tracking.backends=[console,mlflow]"])


def test_import_extra_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'roll-rl\[some_extra\]'"):
        import_extra("roll_no_such_module", "some_extra")


def test_backend_options_without_the_backend_are_refused_at_load() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["tracking.wandb.project=demo", "tracking.mlflow.experiment=demo"])
    message = str(info.value)
    assert "tracking.wandb.project set, but tracking.backends has no wandb: add wandb" in message
    assert "tracking.mlflow.experiment set, but tracking.backends has no mlflow" in message


def test_tracker_state_is_written_only_for_backends_that_have_one(tmp_path: Path) -> None:
    with Tracker(tmp_path, "demo", 3, ["jsonl"]) as tracker:
        tracker.save_state(tmp_path, 2)
    assert read_tracker_state(tmp_path) is None
    saved = {"wandb": {"run_id": "x"}}
    (tmp_path / TRACKER_STATE_FILE).write_text(json.dumps({"step": 2, "backends": saved}))
    assert read_tracker_state(tmp_path) == TrackerResume(2, saved)


def test_mlflow_params_are_dotted_config_keys_with_valid_names() -> None:
    flat = flatten_config({"actor": {"lr": 0.1, "device_mapping": [0, 1]}, "run_name": "x", "domains": {}})
    assert flat == {"actor.lr": "0.1", "actor.device_mapping": "[0, 1]", "run_name": "x", "domains": "{}"}
    assert mlflow_name("eval/math@1 (greedy)") == "eval/math_1 _greedy_"
