"""Weights & Biases: the resolved config, every recorded step's metrics, and example generations as tables,
in one W&B run that a resumed run continues.

W&B's step axis is the training step itself (``run.log(metrics, step=step)``), so W&B's ``_step`` and the
run's step are one number and a rewind can name it. W&B's history is append-only and W&B drops any step
lower than the last one it holds, so a run resumed from the checkpoint of step k opens the W&B run with
``resume_from="<id>?_step=k"`` (W&B's run rewind): W&B cuts the history after k and the steps run again are
logged once, with the values of the run that goes on. Rewind is a preview feature of W&B cloud; where the
server refuses it, or ``tracking.wandb.rewind`` is false, the run is continued (``resume="allow"``) and the
steps W&B already holds keep their first values (``metrics.jsonl`` in the run directory has the new ones).

Offline (``tracking.wandb.mode: offline``) every process and every in-job restart writes one directory
``<output_dir>/wandb/offline-run-*-<id>`` holding the rewind point; ``wandb sync`` them oldest first.
"""

from __future__ import annotations

import os
from typing import Any

from roll.trackers.base import TRACKER_BACKENDS, TrackingBackend, TrackingContext
from roll.utils.extras import import_extra

SAMPLES_KEY = "samples"


@TRACKER_BACKENDS.register("wandb", extra="wandb")
class WandbBackend(TrackingBackend):
    """One W&B run per training run, continued (by its id, kept in each checkpoint) when the run resumes."""

    def __init__(self, context: TrackingContext) -> None:
        super().__init__(context)
        self.wandb = import_extra("wandb", "wandb")
        self.options = context.section("wandb")
        resume = context.resume
        saved = resume.states.get("wandb") if resume is not None else None
        self.run_id: str | None = saved["run_id"] if saved else None
        # The last step logged since the run was opened; a rewind to it or later has nothing to cut.
        self.last_step = -1
        self.run, _ = self._open(resume.step if resume is not None and saved else None)
        # W&B drops steps below this one (it holds them already); they are skipped here, with one message.
        self.first_step: int = self.run.starting_step
        self.told_skip = False

    def _open(self, rewind_to: int | None) -> tuple[Any, bool]:
        """A new run, or this run again: rewound to ``rewind_to`` when asked and the server allows it,
        else continued. Returns the run and whether it was rewound."""
        options, context = self.options, self.context
        kwargs: dict[str, Any] = {
            "project": options.project,
            "entity": options.entity,
            "name": context.run_name,
            "tags": options.tags or None,
            "mode": options.mode,
            "config": dict(context.config) if context.config is not None else None,
            # Never hand back (or finish) a W&B run that the program using roll opened itself.
            "reinit": "create_new",
        }
        if "WANDB_DIR" not in os.environ:  # the run directory holds everything of the run
            kwargs["dir"] = str(context.output_dir)
        if self.run_id is None:
            run = self.wandb.init(**kwargs)
            self.run_id = run.id
            return run, False
        if rewind_to is not None and options.rewind:
            try:
                return self.wandb.init(resume_from=f"{self.run_id}?_step={rewind_to}", **kwargs), True
            except Exception as error:  # noqa: BLE001 - W&B raises several kinds; the run must go on
                self._print(
                    f"WARNING: W&B could not rewind run {self.run_id} to step {rewind_to} ({error}); "
                    "continuing it instead, so the steps W&B already holds keep their first values "
                    "(tracking.wandb.rewind=false skips this attempt)"
                )
        return self.wandb.init(id=self.run_id, resume="allow", **kwargs), False

    def _print(self, message: str) -> None:
        self.context.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def _skip(self, step: int) -> bool:
        if step >= self.first_step:
            return False
        if not self.told_skip:
            self.told_skip = True
            self._print(
                f"W&B run {self.run_id} already holds steps up to {self.first_step - 1}: steps {step} to "
                f"{self.first_step - 1} keep their first values there (metrics.jsonl has the new ones)"
            )
        return True

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._skip(step):
            return
        self.run.log(dict(metrics), step=step)
        self.last_step = max(self.last_step, step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if self._skip(step):
            return
        columns = list(samples[0])
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in samples])
        self.run.log({SAMPLES_KEY: table}, step=step)
        self.last_step = max(self.last_step, step)

    def rewind(self, step: int) -> None:
        """An in-job restart from the checkpoint of ``step``: the run is finished and opened again rewound
        to ``step``; without rewind the steps up to the last one logged are skipped instead."""
        if self.last_step <= step:
            return
        held = self.last_step
        rewound = False
        if self.options.rewind:
            self.run.finish()
            self.run, rewound = self._open(step)
        self.first_step = self.run.starting_step if rewound else max(self.run.starting_step, held + 1)
        self.last_step = step
        self.told_skip = False

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self.run.finish()
