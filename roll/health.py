"""Run-health monitors over the metric stream: the ways an RL run goes wrong while its loss looks fine.

Each monitor reads a few metrics of every step (or of every evaluation) from a ``MetricHistory`` and
says what it sees wrong, or nothing. ``HealthMonitors`` runs them: a monitor fires once per episode of
trouble (after its rule has held ``patience`` steps in a row; again only after it has cleared as long),
and a firing writes ``<output_dir>/health/step_<N>_<monitor>.json`` (the recent metrics, the early
levels and the step's example samples) and returns a ``HealthEvent`` for the run loop to report, log as
``health/<monitor>`` and, with ``action: stop``, end the run on (``HealthStop``).

A new monitor is one ``Monitor`` subclass plus one ``MONITORS`` entry and a config section of the same
name in ``roll.config.health.HealthConfig``. Nothing here imports torch or Ray: tests feed synthetic
streams.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from roll.utils.registry import Registry

if TYPE_CHECKING:
    from roll.config.health import HealthConfig

HEALTH_PREFIX = "health/"
HEALTH_DIR = "health"
# ``roll train`` exits with this code when a monitor stopped the run (1: an error, 2: a bad config).
HEALTH_STOP_EXIT_CODE = 3
# Evaluations kept in the history (eval-based rules look back a few; the best score is kept apart).
KEEP_EVALS = 64


class HealthStop(RuntimeError):
    """A monitor with ``action: stop`` fired; the message names it, the step, the dump and the checkpoint."""


@dataclass(frozen=True)
class Finding:
    """What a monitor sees wrong on a step. ``at_once``: fire without waiting out the patience (NaN)."""

    saw: str
    at_once: bool = False


@dataclass(frozen=True)
class HealthEvent:
    """A monitor that fired: at ``step`` it ``saw`` something; ``advice`` says what to try."""

    monitor: str
    step: int
    action: str
    saw: str
    advice: str
    dump: Path

    def message(self) -> str:
        return (
            f"health: {self.monitor} at step {self.step}: {self.saw}. Try: {self.advice}. "
            f"Metrics and samples: {self.dump}"
        )


# ----- the history ---------------------------------------------------------------------------------------


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def median(values: Iterable[float]) -> float | None:
    """Median of the finite ``values``; None when there is none."""
    finite = _finite(values)
    return statistics.median(finite) if finite else None


def trend(values: Sequence[float]) -> float:
    """The change across ``values`` that a least-squares line through them (equally spaced) implies: a
    single noisy point moves it less than a first-to-last difference."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    spread = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / spread
    return slope * (n - 1)


class MetricHistory:
    """The metrics monitors read: per metric its first ``baseline_steps`` values (the early level) and the
    last ``keep_steps`` steps; each evaluation's ``eval/`` scores with the training reward smoothed over
    the steps before it. ``current`` holds the metrics of the step being judged."""

    def __init__(self, baseline_steps: int, window: int, keep_steps: int) -> None:
        self.baseline_steps = baseline_steps
        self.window = window
        self.rows: deque[tuple[int, dict[str, float]]] = deque(maxlen=keep_steps)
        self.early: dict[str, list[tuple[int, float]]] = {}
        self.evals: deque[tuple[int, dict[str, float]]] = deque(maxlen=KEEP_EVALS)
        self.best: dict[str, float] = {}  # each eval score's best so far (evaluations beyond KEEP_EVALS too)
        self.current: dict[str, float] = {}

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        """Keep the step's metrics that ``watched`` accepts; ``eval/`` ones also as an evaluation."""
        self.current = {k: float(v) for k, v in metrics.items() if watched(k)}
        train = {k: v for k, v in self.current.items() if not k.startswith("eval/")}
        if train:
            self.rows.append((step, train))
            for key, value in train.items():
                early = self.early.setdefault(key, [])
                if len(early) < self.baseline_steps:
                    early.append((step, value))
        scores = {k: v for k, v in self.current.items() if k.startswith("eval/")}
        if scores:
            reward = self.smoothed("reward/mean") if train else None
            self.evals.append((step, {**scores, **({} if reward is None else {SMOOTHED_REWARD: reward})}))

    def remember_best(self) -> None:
        """Fold the current evaluation into the best scores (after the monitors compared against them)."""
        for key, value in self.current.items():
            if key.startswith("eval/") and math.isfinite(value):
                self.best[key] = max(self.best.get(key, value), value)

    def recent(self, key: str, count: int) -> list[float]:
        """The last ``count`` values of ``key`` (fewer early in the run), oldest first."""
        values = [row[key] for _, row in self.rows if key in row]
        return values[-count:]

    def smoothed(self, key: str) -> float | None:
        """Median of the last ``window`` values of ``key``; None until there are that many."""
        values = self.recent(key, self.window)
        return median(values) if len(values) == self.window else None

    def warmed_up(self, key: str) -> bool:
        """Whether ``key`` has ``baseline_steps`` values: no rule judges it before."""
        return len(self.early.get(key, ())) == self.baseline_steps

    def early_level(self, key: str) -> float | None:
        """Median of the first ``baseline_steps`` values of ``key``; None until there are that many."""
        return median(v for _, v in self.early[key]) if self.warmed_up(key) else None

    def eval_rows(self, key: str) -> list[tuple[int, dict[str, float]]]:
        return [(step, row) for step, row in self.evals if key in row]

    def rewind(self, step: int) -> None:
        """Forget what came after ``step`` (the run goes on from a checkpoint of that step)."""
        self.rows = deque(((s, r) for s, r in self.rows if s <= step), maxlen=self.rows.maxlen)
        self.evals = deque(((s, r) for s, r in self.evals if s <= step), maxlen=KEEP_EVALS)
        self.early = {k: [(s, v) for s, v in e if s <= step] for k, e in self.early.items()}
        self.best = {}
        for _, row in self.evals:
            for key, value in row.items():
                if key != SMOOTHED_REWARD and math.isfinite(value):
                    self.best[key] = max(self.best.get(key, value), value)
        self.current = {}

    def state_dict(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "early": self.early, "evals": list(self.evals), "best": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows = deque(state["rows"], maxlen=self.rows.maxlen)
        self.early = {k: list(v) for k, v in state["early"].items()}
        self.evals = deque(state["evals"], maxlen=KEEP_EVALS)
        self.best = dict(state["best"])
        self.current = {}


# The training reward smoothed up to an evaluation, stored with its scores (reward hacking compares them).
SMOOTHED_REWARD = "reward/mean@eval"


def is_eval_score(key: str) -> bool:
    """``eval/score`` and each domain's ``eval/<domain>/score``."""
    parts = key.split("/")
    return key == "eval/score" or (len(parts) == 3 and parts[0] == "eval" and parts[2] == "score")


# ----- the monitors ------------------------------------------------------------------------------------


class Monitor(ABC):
    """One rule over the history. ``check`` says what it sees wrong on the step being judged, or None.

    A step-based monitor is judged on every step that logs one of its ``keys``; an eval-based one on
    every evaluation. ``fire_after``: judged steps in trouble in a row before it fires; ``rearm_after``:
    judged steps clear in a row before it can fire again."""

    advice: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, section: Any, health: HealthConfig) -> None:
        """``name``: its registry name, which is also its section's key under ``health``."""
        self.name = name
        self.section = section
        self.health = health

    @property
    def action(self) -> str:
        return self.section.action or self.health.action

    @property
    def fire_after(self) -> int:
        return self.health.patience

    @property
    def rearm_after(self) -> int:
        return self.fire_after

    @property
    def keep_steps(self) -> int:
        """Steps of history the rule reads."""
        return self.health.window

    def judged(self, history: MetricHistory) -> bool:
        return any(key in history.current for key in self.keys)

    @abstractmethod
    def check(self, history: MetricHistory) -> Finding | None: ...


MONITORS: Registry[type[Monitor]] = Registry("health monitor")


def _below_early(history: MetricHistory, key: str, fraction: float) -> Finding | None:
    """The smoothed ``key`` below ``fraction`` of its early level."""
    early, now = history.early_level(key), history.smoothed(key)
    if early is None or now is None or early <= 0 or now >= fraction * early:
        return None
    return Finding(
        f"{key} {now:.3g} (median of the last {history.window} steps) is below {fraction:g} x its early "
        f"level {early:.3g}"
    )


@MONITORS.register("entropy_collapse")
class EntropyCollapse(Monitor):
    keys = ("actor/entropy",)
    advice = (
        "a higher rollout.temperature, algorithm.entropy_coef > 0 (e.g. 0.001), a lower actor.lr, or "
        "DAPO clip-higher (algorithm.clip_ratio_high 0.28)"
    )

    def check(self, history: MetricHistory) -> Finding | None:
        return _below_early(history, "actor/entropy", self.section.fraction)


@MONITORS.register("length_runaway")
class LengthRunaway(Monitor):
    keys = ("response/length_mean", "response/truncated_frac")
    advice = (
        "a larger rollout.max_new_tokens if the answers need it, else an overlong penalty "
        "(algorithm.reward_shaping.overlong_buffer), a lower actor.lr, or a reward that does not favour "
        "length"
    )

    def check(self, history: MetricHistory) -> Finding | None:
        key = "response/length_mean"
        early, now = history.early_level(key), history.smoothed(key)
        growth = self.section.growth
        if early is not None and now is not None and early > 0 and now > growth * early:
            return Finding(
                f"{key} {now:.3g} (median of the last {history.window} steps) is above {growth:g} x its "
                f"early level {early:.3g}"
            )
        # Grown there or there from the start: either way most answers are cut before they end.
        key, limit = "response/truncated_frac", self.section.truncated_frac
        early, now = history.early_level(key), history.smoothed(key)
        if early is not None and now is not None and now >= limit:
            return Finding(
                f"{key} {now:.3g} (median of the last {history.window} steps) is at or above {limit:g}: "
                f"most responses hit rollout.max_new_tokens (early level {early:.3g})"
            )
        return None


@MONITORS.register("length_collapse")
class LengthCollapse(Monitor):
    keys = ("response/length_mean",)
    advice = (
        "look at the samples in the dump: an empty or one-token answer that still scores means the reward "
        "is exploitable; otherwise a lower actor.lr or a KL term (algorithm.kl_coef > 0)"
    )

    def check(self, history: MetricHistory) -> Finding | None:
        return _below_early(history, "response/length_mean", self.section.fraction)


@MONITORS.register("all_same_groups")
class AllSameGroups(Monitor):
    keys = ("reward/all_same_group_frac",)
    advice = (
        "if the groups are all right, harder prompts; if all wrong, easier ones or an SFT warm start; "
        "else a larger rollout.num_return_sequences, a higher rollout.temperature, or dynamic sampling "
        "(rollout.group_filters: [equal_rewards])"
    )

    def check(self, history: MetricHistory) -> Finding | None:
        key, limit = "reward/all_same_group_frac", self.section.max_frac
        now = history.smoothed(key)
        if not history.warmed_up(key) or now is None or now < limit:
            return None
        reward = history.smoothed("reward/mean")
        which = f" (reward/mean {reward:.3g})" if reward is not None else ""
        return Finding(
            f"{key} {now:.3g} (median of the last {history.window} steps) is at or above {limit:g}: most "
            f"groups carry no learning signal{which}"
        )


class Blowup(Monitor):
    """A metric far above its running median on ``steps`` steps in a row, or NaN/inf."""

    @property
    def fire_after(self) -> int:
        return 1  # the rule itself waits for ``steps`` steps in a row

    @property
    def rearm_after(self) -> int:
        return self.section.steps

    @property
    def keep_steps(self) -> int:
        return self.section.reference_steps + self.section.steps

    def check(self, history: MetricHistory) -> Finding | None:
        s = self.section
        for key in self.keys:
            if key not in history.current:
                continue
            value = history.current[key]
            if not math.isfinite(value):
                return Finding(f"{key} is {value}", at_once=True)
            values = history.recent(key, s.reference_steps + s.steps)
            reference = median(values[: -s.steps])
            # The reference must be as long as the early level, or the first steps' values judge a run.
            if (
                len(values) - s.steps < min(s.reference_steps, self.health.baseline_steps)
                or reference is None
            ):
                continue
            limit = max(s.factor * reference, s.min_value)
            if all(v > limit for v in values[-s.steps :]):
                return Finding(
                    f"{key} {value:.3g} has been above {s.factor:g} x its running median {reference:.3g} "
                    f"for {s.steps} steps"
                )
        return None


@MONITORS.register("kl_blowup")
class KLBlowup(Blowup):
    keys = ("actor/kl", "reward/kl")
    advice = (
        "a lower actor.lr, a higher algorithm.kl_coef (or algorithm.kl_target), a smaller "
        "algorithm.clip_ratio_high, or fewer actor.ppo_epochs"
    )


@MONITORS.register("grad_norm_blowup")
class GradNormBlowup(Blowup):
    keys = ("actor/grad_norm", "critic/grad_norm")
    advice = (
        "a lower actor.lr (or critic.lr), actor.warmup_steps, actor.max_grad_norm > 0, or look for "
        "outlier samples in the dump (very long or degenerate responses)"
    )


@MONITORS.register("reward_hacking")
class RewardHacking(Monitor):
    keys = ("eval/score",)
    advice = (
        "read the samples in the dump: a response that scores without solving the task means the reward "
        "can be gamed; tighten the reward function, or use eval_reward for a stricter held-out score"
    )

    @property
    def fire_after(self) -> int:
        return 1  # the rule itself spans ``evals`` evaluations

    def check(self, history: MetricHistory) -> Finding | None:
        s = self.section
        rows = [row for _, row in history.eval_rows("eval/score") if SMOOTHED_REWARD in row][-s.evals :]
        if len(rows) < s.evals:
            return None
        rise = trend([row[SMOOTHED_REWARD] for row in rows])
        fall = -trend([row["eval/score"] for row in rows])
        if rise < s.min_rise or fall < s.min_drop:
            return None
        return Finding(
            f"over the last {s.evals} evaluations the training reward rose by {rise:.3g} while eval/score "
            f"fell by {fall:.3g} (least-squares trends)"
        )


@MONITORS.register("eval_drop")
class EvalDrop(Monitor):
    advice = (
        "go back to the best checkpoint, then a lower actor.lr, a KL term (algorithm.kl_coef > 0) or a "
        "smaller clip ratio; with a drop right after a warm start, actor.warmup_steps"
    )

    @property
    def fire_after(self) -> int:
        return self.section.evals

    @property
    def rearm_after(self) -> int:
        return 1

    def judged(self, history: MetricHistory) -> bool:
        return any(is_eval_score(key) for key in history.current)

    def check(self, history: MetricHistory) -> Finding | None:
        drop = self.section.drop
        for key, value in history.current.items():
            best = history.best.get(key)
            if is_eval_score(key) and best is not None and value < best - drop:
                return Finding(f"{key} {value:.3g} is more than {drop:g} below its best {best:.3g}")
        return None


def watched(key: str) -> bool:
    """Whether any monitor reads ``key`` (the history keeps only those, and reward/mean for context)."""
    return (
        key == "reward/mean" or is_eval_score(key) or any(key in m.keys for m in map(MONITORS.get, MONITORS))
    )


# ----- running them ------------------------------------------------------------------------------------


@dataclass
class Episode:
    """Where a monitor stands: judged steps in trouble (``streak``) or clear (``clear``) in a row, and
    whether it has fired for the trouble now going on (``active``)."""

    streak: int = 0
    clear: int = 0
    active: bool = False

    def update(self, finding: Finding | None, fire_after: int, rearm_after: int) -> bool:
        """Count one judged step; returns whether the monitor fires on it."""
        if finding is None:
            self.streak, self.clear = 0, self.clear + 1
            if self.active and self.clear >= rearm_after:
                self.active = False
            return False
        self.streak, self.clear = self.streak + 1, 0
        if self.active or (self.streak < fire_after and not finding.at_once):
            return False
        self.active = True
        return True


def monitor_sections(health: HealthConfig) -> dict[str, Any]:
    """Each monitor's section of a ``health`` config by name (the name ``MONITORS`` registers it under):
    its fields that are dataclasses."""
    return {
        f.name: getattr(health, f.name)
        for f in dataclasses.fields(health)
        if dataclasses.is_dataclass(getattr(health, f.name))
    }


class HealthMonitors:
    """Runs the enabled monitors of ``config`` on each step's metrics (``observe``); dumps go to
    ``<output_dir>/health``. Its state (history and episodes) goes into checkpoints, so a resumed run
    neither forgets its early levels nor fires again for trouble it already reported."""

    def __init__(self, config: HealthConfig, output_dir: str | Path) -> None:
        self.config = config
        self.directory = Path(output_dir) / HEALTH_DIR
        sections = monitor_sections(config)
        self.monitors = [
            MONITORS.get(name)(name, section, config) for name, section in sections.items() if section.enabled
        ]
        keep = max([config.window, *(m.keep_steps for m in self.monitors)])
        self.history = MetricHistory(config.baseline_steps, config.window, keep)
        self.episodes = {m.name: Episode() for m in self.monitors}

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        """Remember ``metrics`` without judging them (the evaluation before training)."""
        self.history.record(step, metrics)
        self.history.remember_best()

    def observe(
        self, step: int, metrics: Mapping[str, float], samples: Sequence[Mapping[str, Any]] = ()
    ) -> list[HealthEvent]:
        """Judge ``step``'s metrics; returns the monitors that fire on it (each with its dump written)."""
        self.history.record(step, metrics)
        events = []
        for monitor in self.monitors:
            if not monitor.judged(self.history):
                continue
            finding = monitor.check(self.history)
            if self.episodes[monitor.name].update(finding, monitor.fire_after, monitor.rearm_after):
                assert finding is not None
                events.append(self._fire(monitor, step, finding, samples))
        self.history.remember_best()
        return events

    def _fire(
        self, monitor: Monitor, step: int, finding: Finding, samples: Sequence[Mapping[str, Any]]
    ) -> HealthEvent:
        path = self.directory / f"step_{step}_{monitor.name}.json"
        event = HealthEvent(monitor.name, step, monitor.action, finding.saw, monitor.advice, path)
        history = self.history
        dump = {
            "monitor": monitor.name,
            "step": step,
            "action": event.action,
            "saw": event.saw,
            "advice": event.advice,
            "settings": {
                **{k: getattr(self.config, k) for k in ("baseline_steps", "window", "patience")},
                monitor.name: dataclasses.asdict(monitor.section),
            },
            "early_levels": {k: history.early_level(k) for k in history.early},
            "metrics": [{"step": s, **row} for s, row in history.rows],
            "evals": [{"step": s, **row} for s, row in history.evals],
            "samples": [dict(sample) for sample in samples],
        }
        _write_json(path, dump)
        return event

    def rewind(self, step: int) -> None:
        """Forget what came after ``step`` and every episode (a restart with no checkpoint to load)."""
        self.history.rewind(step)
        self.episodes = {name: Episode() for name in self.episodes}

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history.state_dict(),
            "episodes": {name: dataclasses.asdict(e) for name, e in self.episodes.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Take back ``state_dict``; None (a checkpoint written before monitors existed) starts afresh."""
        if state is None:
            self.rewind(-1)
            return
        self.history.load_state_dict(state["history"])
        saved = state["episodes"]
        self.episodes = {
            name: Episode(**saved[name]) if name in saved else Episode() for name in self.episodes
        }


def stop_message(events: Sequence[HealthEvent], checkpoint: Path, output_dir: str | Path) -> str:
    """What ``roll train`` prints when monitors stopped the run: which, where, and how to go on."""
    stops = [e for e in events if e.action == "stop"]
    seen = "; ".join(f"{e.monitor} at step {e.step}: {e.saw} (dump: {e.dump})" for e in stops)
    warn = " ".join(f"health.{e.monitor}.action=warn" for e in stops)
    off = " ".join(f"health.{e.monitor}.enabled=false" for e in stops)
    return (
        f"stopped by the health monitor {seen}. The checkpoint of step {stops[0].step} is {checkpoint}. Go "
        f"on from it with: roll resume {output_dir} (a monitor that fired stays quiet until its trouble "
        f"clears); add {warn} to only warn, or {off} to turn {'them' if len(stops) > 1 else 'it'} off"
    )


def _json_safe(value: Any) -> Any:
    """NaN and infinity as null: JSON has no literal for them (as in metrics.jsonl)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(_json_safe(content), indent=1, allow_nan=False, default=str) + "\n")
    os.replace(staging, path)  # a reader never sees half a dump
