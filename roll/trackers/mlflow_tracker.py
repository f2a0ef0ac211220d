"""MLflow: the resolved config (as params and as ``config.json``), every recorded step's metrics at that
step, and example generations as the table ``samples.json``, in one MLflow run that a resumed run continues.

MLflow cannot delete metric points, so after a resume (or an in-job restart) from the checkpoint of step k
the steps after k that the first attempt logged stay in the history next to the new ones. Each such rewind
is recorded in the run's tag ``roll.rewinds`` (a JSON list of ``{"step", "time_ms"}``): a point of a step
after a rewind's ``step`` logged before its ``time_ms`` belongs to the abandoned attempt (``kept_points``
drops them). The samples table is rewritten without its rows after k.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from roll.trackers.base import TRACKER_BACKENDS, TrackingBackend, TrackingContext
from roll.utils.extras import import_extra

SAMPLES_TABLE = "samples.json"
CONFIG_ARTIFACT = "config.json"
REWINDS_TAG = "roll.rewinds"
# MLflow rejects any other character in metric and param names.
_INVALID_NAME_CHARS = re.compile(r"[^\w.\- :/]")
T = TypeVar("T")


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@contextmanager
def _no_download_bars() -> Iterator[None]:
    """MLflow draws a progress bar for each artifact it downloads; appending to the samples table downloads
    it every time, which would put a bar in the run's log every ``samples_every`` steps."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    if name in os.environ:  # the user's choice stands
        yield
        return
    os.environ[name] = "false"
    try:
        yield
    finally:
        os.environ.pop(name, None)


def mlflow_name(key: str) -> str:
    """``key`` with the characters MLflow refuses in a metric or param name replaced by ``_``."""
    return _INVALID_NAME_CHARS.sub("_", key)


def kept_points(points: Sequence[Any], rewinds: Sequence[Mapping[str, int]]) -> list[Any]:
    """The points of a metric history (``MlflowClient.get_metric_history``: each with ``step`` and
    ``timestamp`` in ms) that the run kept, given its ``roll.rewinds`` tag: a point of a step after a
    rewind's ``step``, logged before that rewind, belongs to an abandoned attempt."""
    return [
        point
        for point in points
        if not any(point.step > rewind["step"] and point.timestamp < rewind["time_ms"] for rewind in rewinds)
    ]


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys (``actor.lr``) to text values (JSON for anything but a string), one per leaf."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[mlflow_name(name)] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


@TRACKER_BACKENDS.register("mlflow", extra="mlflow")
class MlflowBackend(TrackingBackend):
    """One MLflow run per training run, continued (by its id, kept in each checkpoint) on resume."""

    def __init__(self, context: TrackingContext) -> None:
        super().__init__(context)
        import_extra("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        options = context.section("mlflow")
        self.client = MlflowClient(tracking_uri=options.tracking_uri)
        saved = context.resume.states.get("mlflow") if context.resume is not None else None
        run = self._reopen(saved["run_id"]) if saved else None
        if run is None:
            run = self.client.create_run(self._experiment_id(options.experiment), run_name=context.run_name)
            # Nothing logged yet: a rewind before the first step has nothing to mark.
            self.last_step: float = -1
        else:
            # What the run logged after the checkpoint is unknown, so the first rewind is always marked.
            self.last_step = math.inf
        self.run_id: str = run.info.run_id
        self.rewinds: list[dict[str, int]] = json.loads(run.data.tags.get(REWINDS_TAG, "[]"))
        # Points are stamped no earlier than the last rewind, so none logged after it reads as abandoned.
        self.floor_ms = 0
        if context.config is not None:
            self._log_config(context.config, run.data.params)

    def _print(self, message: str) -> None:
        self.context.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def _reopen(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            self._print(
                f"WARNING: MLflow run {run_id} of the checkpoint cannot be opened in "
                f"{self.client.tracking_uri} ({error.message}); logging to a new run"
            )
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run

    def _experiment_id(self, name: str | None) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self.client.create_experiment(name)

    def _log_config(self, config: Mapping[str, Any], logged: Mapping[str, str]) -> None:
        """Params for the keys the run has none of yet (MLflow refuses to change a param's value) and
        ``config.json``, which always holds the config of the latest start."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        flat = flatten_config(config)
        new = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flat.items() if k not in logged]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=list(chunk))
        changed = sorted(k for k, v in flat.items() if k in logged and logged[k] != v[:MAX_PARAM_VAL_LENGTH])
        if changed:
            self._print(
                f"MLflow params keep the values of the run's first start: {', '.join(changed)} changed "
                f"(the resumed config is in the run's artifact {CONFIG_ARTIFACT})"
            )
        self.client.log_dict(self.run_id, dict(config), CONFIG_ARTIFACT)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = max(int(time.time() * 1000), self.floor_ms)
        points = [Metric(mlflow_name(key), float(value), now, step) for key, value in metrics.items()]
        for chunk in _chunks(points, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=list(chunk))
        self.last_step = max(self.last_step, step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Rows appended to the table ``samples.json`` (MLflow's table artifact), a ``step`` column first."""
        columns = ["step", *(key for key in samples[0] if key != "step")]
        table = {c: [step if c == "step" else row.get(c) for row in samples] for c in columns}
        with _no_download_bars():
            self.client.log_table(self.run_id, table, SAMPLES_TABLE)
        self.last_step = max(self.last_step, step)

    def rewind(self, step: int) -> None:
        """Mark the rewind in the tag ``roll.rewinds`` and cut the samples table after ``step``; the metric
        points after ``step`` stay (MLflow cannot delete them)."""
        if self.last_step <= step:
            return
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        # One ms after now: every point logged so far is strictly earlier, every later one is not.
        self.floor_ms = int(time.time() * 1000) + 1
        self.rewinds.append({"step": step, "time_ms": self.floor_ms})
        while len(json.dumps(self.rewinds)) > MAX_TAG_VAL_LENGTH:  # hundreds of restarts: keep the latest
            self.rewinds.pop(0)
        self.client.set_tag(self.run_id, REWINDS_TAG, json.dumps(self.rewinds))
        self._cut_samples(step)
        self.last_step = step

    def _cut_samples(self, step: int) -> None:
        if SAMPLES_TABLE not in {entry.path for entry in self.client.list_artifacts(self.run_id)}:
            return
        with tempfile.TemporaryDirectory() as directory, _no_download_bars():
            path = self.client.download_artifacts(self.run_id, SAMPLES_TABLE, directory)
            table = json.loads(Path(path).read_text(encoding="utf-8"))
        column = table["columns"].index("step")
        table["data"] = [row for row in table["data"] if row[column] <= step]
        # The same layout log_table writes (pandas "split"), so later appends and the UI still read it.
        self.client.log_dict(self.run_id, table, SAMPLES_TABLE)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
