"""The run loop every pipeline shares: steps, the evaluation cadence, checkpoints, stop signals, and
restarts from the last checkpoint when a trainer is lost. A pipeline gives its own ``step`` and
``evaluate``, what its checkpoints hold beside the trainers' state, and how its workers start again.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roll import checkpoint
from roll.data.prompts import PromptSet
from roll.distributed.cluster import Cluster, WorkerError
from roll.health import HEALTH_PREFIX, HealthEvent, HealthMonitors, HealthStop, stop_message
from roll.pipelines.common import (
    begin_run,
    checkpoint_due,
    is_eval_step,
    load_run_checkpoint,
    open_tracker,
    save_run_checkpoint,
)
from roll.pipelines.recovery import RestartBudget, lost_workers
from roll.pipelines.run_dir import RunDirectory
from roll.tracking import Tracker
from roll.utils import signals
from roll.utils.signals import set_activity


class RunLoop(abc.ABC):
    """``run()`` trains for ``total_steps`` steps. Each step is ``step(i)``, then ``evaluate()`` on the
    ``eval`` cadence (and once before the first step); metrics go to the tracker; checkpoints are saved on
    the ``checkpoint`` cadence. An error of ``restartable`` (a lost trainer) starts the workers again
    (``restart_workers``) from the last valid checkpoint, within ``checkpoint.max_restarts``; a stop
    signal ends the run after the step in progress when a checkpoint will hold it."""

    config: Any
    run_dir: RunDirectory
    budget: RestartBudget
    eval_prompts: PromptSet | None
    # How the run names its training in progress lines: "RL" -> "RL step 12 of 3000".
    name: str = "RL"
    restartable: tuple[type[BaseException], ...] = (WorkerError,)
    # The run-health monitors (``roll.health``) of a config with a ``health`` section, while it trains.
    health: HealthMonitors | None = None
    # Example generations of the last step (``example_samples``), for the tracker and the health monitors.
    recent_samples: Sequence[dict[str, Any]] = ()

    @property
    def evaluates(self) -> bool:
        """Whether the run has a held-out evaluation (held-out prompts by default)."""
        return self.eval_prompts is not None

    # ----- what a pipeline gives -----------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def total_steps(self) -> int: ...

    @abc.abstractmethod
    def step(self, step: int) -> dict[str, float]: ...

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]: ...

    @abc.abstractmethod
    def clusters(self) -> dict[str, Cluster]:
        """Every live cluster by role."""

    @abc.abstractmethod
    def trainers(self) -> dict[str, Cluster]:
        """The clusters whose state a checkpoint holds (weights, optimizer, schedule, RNG)."""

    @abc.abstractmethod
    def driver_state(self) -> dict[str, Any]:
        """What a checkpoint holds beside the trainers' state and the run's results (data order, ...)."""

    @abc.abstractmethod
    def load_driver_state(self, state: dict[str, Any]) -> None:
        """Take back ``driver_state`` from a checkpoint's state (after the trainers loaded theirs)."""

    @abc.abstractmethod
    def restart_workers(self, lost: dict[str, list[int]]) -> str:
        """Stop and start again the workers a restart needs (``lost`` names the lost ranks by role);
        returns how long each part took, for the log line."""

    @abc.abstractmethod
    def finish(self, tracker: Tracker, results: dict[str, float], metrics: dict[str, float]) -> Any:
        """After the last step: save the model, say what the run did; returns what ``run`` returns."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def on_start(self, tracker: Tracker) -> None:  # noqa: B027 - optional hook
        """Before the first step (and the evaluation before it)."""

    def evaluate_guarded(self) -> dict[str, float]:
        """``evaluate`` as the loop runs it (RLVR replaces lost stateless workers and tries again)."""
        return self.evaluate()

    def after_restart(self) -> None:  # noqa: B027 - optional hook
        """After a restart loaded its checkpoint."""

    def restart_action(self, last: Path | None) -> str:
        return f"restarting every worker from {last or 'the first step'}"

    # ----- the loop ------------------------------------------------------------------------------------

    def run(self) -> Any:
        """Train for ``total_steps`` steps; returns what ``finish`` returns."""
        try:
            return self._train()
        finally:
            # Actors would die with the driver anyway; releasing them now frees a joined cluster.
            self.shutdown()

    def _train(self) -> Any:
        cfg, total = self.config, self.total_steps
        with open_tracker(cfg, total, self.run_dir.resume_from) as tracker:
            # SFT has no ``health`` section: its monitors watch RL runs.
            health = getattr(cfg, "health", None)
            self.health = HealthMonitors(health, cfg.output_dir) if health is not None else None
            self.on_start(tracker)
            evaluate_before = self._evaluate_before if self.evaluates else None
            last, results = begin_run(tracker, self.run_dir.resume_from, self._restore, evaluate_before)
            metrics: dict[str, float] = {}
            step = last + 1
            while step <= total:
                set_activity(f"{self.name} step {step} of {total}")
                try:
                    # A stop signal lets the step finish when a checkpoint can then save it: held back
                    # through the step, its row and its checkpoint, so the last row logged is saved.
                    with signals.deferred(cfg.checkpoint.every_steps > 0):
                        metrics = self._step_and_evaluate(step)
                        metrics["recovery/restarts"] = self.budget.restarts
                        events = self._check_health(step, metrics, tracker)
                        tracker.log(step, metrics)
                        tracker.log_samples(step, self.recent_samples)
                        saved = None
                        if checkpoint_due(cfg.checkpoint, step, total):
                            saved = self.save_checkpoint(step, results, tracker)
                        if any(event.action == "stop" for event in events):
                            # Saved even off the checkpoint cadence: the state that showed the trouble.
                            saved = saved or self.save_checkpoint(step, results, tracker)
                            raise HealthStop(stop_message(events, saved, cfg.output_dir))
                        if saved is None and checkpoint_due(cfg.checkpoint, step, total):
                            # The signal came after the cadence was asked.
                            self.save_checkpoint(step, results, tracker)
                except self.restartable as error:
                    step = self._restart(error, tracker, results) + 1
                    continue
                signals.raise_if_received()
                step += 1
            return self.finish(tracker, results, metrics)

    def _evaluate_before(self) -> dict[str, float]:
        set_activity(f"the evaluation before {self.name}")
        metrics = self.evaluate_guarded()
        if self.health is not None:
            self.health.record(0, metrics)
        return metrics

    def _step_and_evaluate(self, step: int) -> dict[str, float]:
        metrics = self.step(step)
        if self.evaluates and is_eval_step(self.config.eval, step, self.total_steps):
            set_activity(f"the evaluation after {self.name} step {step} of {self.total_steps}")
            metrics.update(self.evaluate_guarded())
        return metrics

    def _check_health(self, step: int, metrics: dict[str, float], tracker: Tracker) -> list[HealthEvent]:
        """Run the health monitors on the step's metrics; each that fires is printed and logged as
        ``health/<monitor>`` = 1 on this step."""
        if self.health is None:
            return []
        events = self.health.observe(step, metrics, self.recent_samples)
        for event in events:
            metrics[f"{HEALTH_PREFIX}{event.monitor}"] = 1
            tracker.print(f"WARNING: {event.message()}")
        return events

    # ----- checkpoints and restarts --------------------------------------------------------------------

    def save_checkpoint(self, step: int, results: dict[str, float], tracker: Tracker) -> Path:
        """The full state after ``step``: the trainers' weights, optimizers, LR schedules and RNGs, the
        run's results and the pipeline's ``driver_state``."""
        return save_run_checkpoint(
            self.config,
            step,
            self.trainers(),
            lambda: {"results": dict(results), "health": self._health_state(), **self.driver_state()},
            tracker,
        )

    def _restore(self, path: Path, results: dict[str, float]) -> int:
        """Load the checkpoint at ``path`` into the workers and the driver; returns its step."""
        state = load_run_checkpoint(path, self.trainers())
        self.load_driver_state(state)
        results.clear()
        results.update(state["results"])
        if self.health is not None:
            self.health.load_state_dict(state.get("health"))
        return state["step"]

    def _health_state(self) -> dict[str, Any] | None:
        return self.health.state_dict() if self.health is not None else None

    def _restart(self, error: BaseException, tracker: Tracker, results: dict[str, float]) -> int:
        """The workers started again from the last valid checkpoint; returns the step the run goes on
        after."""
        lost = lost_workers(error, self.clusters())
        last = checkpoint.latest_valid(checkpoint.checkpoints_root(self.config.output_dir))
        self.budget.spend(error, lost, self.restart_action(last))
        tracker.print(f"WARNING: {self.budget.events[-1]}")
        start = time.perf_counter()
        workers = self.restart_workers(lost)
        started = time.perf_counter()
        if last is not None:
            step = self._restore(last, results)
        else:  # nothing saved yet: the run starts over, keeping the evaluation before training
            step = 0
            for key in [k for k in results if k != "eval/score_before"]:
                del results[key]
            if self.health is not None:
                self.health.rewind(0)
        tracker.rewind(step)
        self.after_restart()
        tracker.print(
            f"restarted after step {step} in {time.perf_counter() - start:.1f} s ({workers}, loading the "
            f"checkpoint {time.perf_counter() - started:.1f} s)"
        )
        return step
