"""Run-health monitors (``roll.health``) on synthetic metric streams: each fires where its trouble starts,
once per episode of trouble, with a dump of the recent metrics and samples; none fires on a healthy noisy
run. A ``health.action=stop`` run ends with a checkpoint of the step (a fake run loop, no Ray)."""

from __future__ import annotations

import json
import math
import os
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from roll import checkpoint
from roll.config import ConfigError, load_config
from roll.config.health import HealthConfig
from roll.config.rlvr import RLVRConfig
from roll.health import (
    HEALTH_STOP_EXIT_CODE,
    MONITORS,
    HealthMonitors,
    HealthStop,
    monitor_sections,
    trend,
)
from roll.pipelines.recovery import RestartBudget
from roll.pipelines.run_loop import RunLoop
from roll.utils import signals

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 300
EVAL_EVERY = 25
# Where trouble starts in the streams below. A step-based monitor sees it once the median of the last
# ``window`` steps is past its threshold (``window // 2 + 1`` steps in), then waits ``patience`` steps.
TROUBLE = 150
DEFAULTS = HealthConfig()
SMOOTHED_FIRE = TROUBLE + DEFAULTS.window // 2 + DEFAULTS.patience - 1
SAMPLES = [{"prompt": "1+2", "response": "3", "reward": 1.0, "response_length": 2}]

Metrics = dict[str, float]


def healthy(step: int, rng: random.Random) -> Metrics:
    """One step of a run that learns: noisy metrics with slow trends and single-step spikes."""
    t = step / STEPS
    metrics = {
        "actor/entropy": 1.0 - 0.6 * t + rng.gauss(0, 0.05),
        "response/length_mean": 10 + rng.gauss(0, 1),
        "response/truncated_frac": max(0.0, 0.05 + rng.gauss(0, 0.03)),
        "reward/mean": 0.2 + 0.5 * t + rng.gauss(0, 0.08),
        "reward/all_same_group_frac": min(1.0, max(0.0, 0.3 + rng.gauss(0, 0.1))),
        "actor/kl": (0.001 + 0.02 * t) * rng.lognormvariate(0, 0.3),
        "actor/grad_norm": rng.lognormvariate(0, 0.4),
    }
    if step % 37 == 0:  # an outlier batch: one step far off, then back
        metrics["actor/grad_norm"] *= 15
        metrics["actor/kl"] *= 20
    if step % EVAL_EVERY == 0:
        metrics["eval/score"] = 0.2 + 0.5 * t + rng.gauss(0, 0.02)
        metrics["eval/math/score"] = 0.1 + 0.5 * t + rng.gauss(0, 0.02)
    return metrics


def stream(change: Callable[[int, Metrics], None] | None = None, seed: int = 0) -> Iterator[Metrics]:
    """Steps 1..STEPS of ``healthy``; ``change(step, metrics)`` edits each step's metrics in place."""
    rng = random.Random(seed)
    for step in range(1, STEPS + 1):
        metrics = healthy(step, rng)
        if change is not None:
            change(step, metrics)
        yield metrics


def run(
    metrics: Iterator[Metrics], output_dir: Path, config: HealthConfig | None = None
) -> tuple[HealthMonitors, list[tuple[int, str]]]:
    """Feed a stream (after an evaluation before training); returns the monitors and (step, monitor) fired."""
    monitors = HealthMonitors(config or HealthConfig(), output_dir)
    monitors.record(0, {"eval/score": 0.2, "eval/math/score": 0.1})
    fired = []
    for step, row in enumerate(metrics, start=1):
        fired += [(event.step, event.monitor) for event in monitors.observe(step, row, SAMPLES)]
    return monitors, fired


def from_trouble(key: str, value: float | Callable[[int], float]) -> Callable[[int, Metrics], None]:
    """From step TROUBLE on, ``key`` is ``value`` (or ``value(step)``)."""

    def change(step: int, metrics: Metrics) -> None:
        if step >= TROUBLE and (key in metrics or not key.startswith("eval/")):
            metrics[key] = value(step) if callable(value) else value

    return change


def test_every_monitor_has_a_config_section_of_its_name() -> None:
    assert set(MONITORS.names()) == set(monitor_sections(HealthConfig()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_noisy_run_fires_nothing(tmp_path: Path, seed: int) -> None:
    _, fired = run(stream(seed=seed), tmp_path)
    assert fired == []
    assert not (tmp_path / "health").exists()


@pytest.mark.parametrize(
    ("monitor", "change", "expected_step"),
    [
        ("entropy_collapse", from_trouble("actor/entropy", 0.02), SMOOTHED_FIRE),
        ("length_runaway", from_trouble("response/length_mean", 40.0), SMOOTHED_FIRE),
        ("length_runaway", from_trouble("response/truncated_frac", 0.8), SMOOTHED_FIRE),
        ("length_collapse", from_trouble("response/length_mean", 1.0), SMOOTHED_FIRE),
        ("all_same_groups", from_trouble("reward/all_same_group_frac", 1.0), SMOOTHED_FIRE),
        # Blow-ups need ``steps`` (3) values in a row above 10 x the running median; NaN fires at once.
        ("kl_blowup", from_trouble("actor/kl", 5.0), TROUBLE + 2),
        ("kl_blowup", from_trouble("actor/kl", math.nan), TROUBLE),
        ("grad_norm_blowup", from_trouble("actor/grad_norm", 100.0), TROUBLE + 2),
        ("grad_norm_blowup", from_trouble("actor/grad_norm", math.inf), TROUBLE),
        # The held-out score falls 0.1 per evaluation after 150 while the reward keeps rising: the fitted
        # trends over the last 4 evaluations (125..200) pass both 0.05 bars at the evaluation of step 200.
        ("reward_hacking", from_trouble("eval/score", lambda step: 0.45 - 0.1 * (step - 150) / 25), 200),
        # Far below the best (about 0.45 at step 125) at the evaluations of steps 150 and 175: two in a row.
        ("eval_drop", from_trouble("eval/score", 0.2), 175),
        ("eval_drop", from_trouble("eval/math/score", 0.05), 175),
    ],
)
def test_each_monitor_fires_once_where_its_trouble_starts(
    tmp_path: Path, monitor: str, change: Callable[[int, Metrics], None], expected_step: int
) -> None:
    # The trouble lasts to the end of the stream: one episode, one firing.
    _, fired = run(stream(change), tmp_path)
    assert [(step, name) for step, name in fired if name == monitor] == [(expected_step, monitor)]
    assert (tmp_path / "health" / f"step_{expected_step}_{monitor}.json").is_file()


@pytest.mark.parametrize(
    ("monitor", "change", "settings", "expected"),
    [
        ("entropy_collapse", from_trouble("actor/entropy", 0.02), {"patience": 5}, [TROUBLE + 5 + 4]),
        ("entropy_collapse", from_trouble("actor/entropy", 0.02), {"window": 4}, [TROUBLE + 2 + 9]),
        # The early level forms at step 200 (still healthy: 150 of its 200 steps are); judging starts there.
        ("entropy_collapse", from_trouble("actor/entropy", 0.02), {"baseline_steps": 200}, [200 + 9]),
        ("entropy_collapse", from_trouble("actor/entropy", 0.02), {"entropy_collapse.fraction": 0.01}, []),
        ("length_runaway", from_trouble("response/length_mean", 40.0), {"length_runaway.growth": 5}, []),
        (
            "length_runaway",
            from_trouble("response/truncated_frac", 0.8),
            {"length_runaway.truncated_frac": 0.9},
            [],
        ),
        (
            "length_collapse",
            from_trouble("response/length_mean", 1.0),
            {"length_collapse.fraction": 0.05},
            [],
        ),
        ("all_same_groups", from_trouble("reward/all_same_group_frac", 0.9), {}, []),
        (
            "all_same_groups",
            from_trouble("reward/all_same_group_frac", 0.9),
            {"all_same_groups.max_frac": 0.85},
            [164],
        ),
        ("kl_blowup", from_trouble("actor/kl", 5.0), {"kl_blowup.steps": 5}, [TROUBLE + 4]),
        ("kl_blowup", from_trouble("actor/kl", 5.0), {"kl_blowup.min_value": 6.0}, []),
        ("kl_blowup", from_trouble("actor/kl", 0.05), {}, []),  # 10x the median, but below min_value 0.1
        ("grad_norm_blowup", from_trouble("actor/grad_norm", 100.0), {"grad_norm_blowup.factor": 200}, []),
        # A median over the last 5 steps only: by the third bad step it holds two of them.
        (
            "grad_norm_blowup",
            from_trouble("actor/grad_norm", 8.0),
            {"grad_norm_blowup.reference_steps": 5},
            [],
        ),
        ("eval_drop", from_trouble("eval/score", 0.2), {"eval_drop.evals": 4}, [225]),
        ("eval_drop", from_trouble("eval/score", 0.2), {"eval_drop.drop": 0.3}, []),
        (
            "reward_hacking",
            from_trouble("eval/score", lambda step: 0.45 - 0.1 * (step - 150) / 25),
            {"reward_hacking.evals": 3, "reward_hacking.min_rise": 0.02},
            [175],
        ),
        (
            "reward_hacking",
            from_trouble("eval/score", lambda step: 0.45 - 0.1 * (step - 150) / 25),
            {"reward_hacking.min_drop": 0.5},
            [],
        ),
        (
            "reward_hacking",
            from_trouble("eval/score", lambda step: 0.45 - 0.1 * (step - 150) / 25),
            {"reward_hacking.min_rise": 0.5},
            [],
        ),
    ],
)
def test_each_setting_moves_or_stops_the_firing(
    tmp_path: Path, monitor: str, change: Callable[[int, Metrics], None], settings: dict, expected: list[int]
) -> None:
    config = HealthConfig()
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(config, section) if section else config, name, value)
    _, fired = run(stream(change), tmp_path, config)
    assert [step for step, name in fired if name == monitor] == expected


def test_a_disabled_monitor_stays_quiet(tmp_path: Path) -> None:
    config = HealthConfig()
    config.entropy_collapse.enabled = False
    _, fired = run(stream(from_trouble("actor/entropy", 0.02)), tmp_path, config)
    assert fired == []


def test_a_monitor_fires_again_only_after_its_trouble_cleared(tmp_path: Path) -> None:
    def flapping(step: int, metrics: Metrics) -> None:
        # Collapsed over 100..139, recovered over 140..199, collapsed again from 200 on.
        if 100 <= step < 140 or step >= 200:
            metrics["actor/entropy"] = 0.02

    _, fired = run(stream(flapping), tmp_path)
    window, patience = DEFAULTS.window, DEFAULTS.patience
    expected = [(start + window // 2 + patience - 1, "entropy_collapse") for start in (100, 200)]
    assert fired == expected


def test_a_short_dip_does_not_fire(tmp_path: Path) -> None:
    # Fewer bad steps than the window's half: the running median never sees them.
    def dip(step: int, metrics: Metrics) -> None:
        if 150 <= step < 150 + DEFAULTS.window // 2:
            metrics["actor/entropy"] = 0.0
            metrics["response/length_mean"] = 0.0

    _, fired = run(stream(dip), tmp_path)
    assert fired == []


def test_nothing_is_judged_before_the_early_level_forms(tmp_path: Path) -> None:
    # Collapsed from the first step: there is no early level to fall from.
    _, fired = run(stream(lambda step, m: m.update({"actor/entropy": 0.02})), tmp_path)
    assert fired == []


@pytest.mark.parametrize(
    ("monitor", "key", "value"),
    [
        ("length_runaway", "response/truncated_frac", 0.9),
        ("all_same_groups", "reward/all_same_group_frac", 1.0),
    ],
)
def test_trouble_from_the_first_step_fires_once_the_early_level_formed(
    tmp_path: Path, monitor: str, key: str, value: float
) -> None:
    # What a collapse within the first steps looks like (the quickstart at actor.lr=1e-3): the share of
    # cut answers or all-same groups is high from the start. Judged from step baseline_steps on.
    _, fired = run(stream(lambda step, m: m.update({key: value})), tmp_path)
    assert fired == [(DEFAULTS.baseline_steps + DEFAULTS.patience - 1, monitor)]


def test_the_dump_holds_the_finding_the_recent_metrics_and_the_samples(tmp_path: Path) -> None:
    run(stream(from_trouble("actor/kl", math.nan)), tmp_path)
    dump = json.loads((tmp_path / "health" / f"step_{TROUBLE}_kl_blowup.json").read_text())
    assert dump["monitor"] == "kl_blowup" and dump["step"] == TROUBLE and dump["action"] == "warn"
    assert "actor/kl is nan" in dump["saw"] and "algorithm.kl_coef" in dump["advice"]
    assert dump["settings"]["kl_blowup"]["factor"] == 10.0 and dump["settings"]["window"] == DEFAULTS.window
    assert dump["samples"] == SAMPLES
    rows = dump["metrics"]
    assert rows[-1]["step"] == TROUBLE and rows[-1]["actor/kl"] is None  # NaN written as null
    assert len(rows) == DEFAULTS.kl_blowup.reference_steps + DEFAULTS.kl_blowup.steps
    assert {"actor/entropy", "reward/mean", "response/length_mean"} <= set(rows[-1])
    assert [row["step"] for row in dump["evals"]] == [0, *range(EVAL_EVERY, TROUBLE + 1, EVAL_EVERY)]
    assert 0.9 < dump["early_levels"]["actor/entropy"] < 1.1


def test_a_monitor_action_overrides_the_global_one(tmp_path: Path) -> None:
    config = HealthConfig(action="warn")
    config.grad_norm_blowup.action = "stop"
    monitors = HealthMonitors(config, tmp_path)
    actions = {monitor.name: monitor.action for monitor in monitors.monitors}
    assert actions["grad_norm_blowup"] == "stop" and actions["entropy_collapse"] == "warn"


def test_state_survives_a_checkpoint_and_a_rewind(tmp_path: Path) -> None:
    bad = from_trouble("actor/entropy", 0.02)
    monitors, fired = run(stream(bad), tmp_path)
    assert fired == [(SMOOTHED_FIRE, "entropy_collapse")]
    # A resumed run takes the state back: same early level, and no second firing for the same trouble.
    resumed = HealthMonitors(HealthConfig(), tmp_path)
    resumed.load_state_dict(torch.load(_saved(tmp_path, monitors.state_dict()), weights_only=False))
    assert resumed.history.early_level("actor/entropy") == monitors.history.early_level("actor/entropy")
    assert resumed.observe(STEPS + 1, {"actor/entropy": 0.02}) == []
    # A restart with no checkpoint forgets everything after step 0 (the evaluation before training stays).
    resumed.rewind(0)
    assert resumed.history.early_level("actor/entropy") is None
    assert resumed.history.best == {"eval/score": 0.2, "eval/math/score": 0.1}
    # A checkpoint saved before monitors existed: start afresh.
    resumed.load_state_dict(None)
    assert resumed.history.best == {} and not resumed.history.rows


def _saved(tmp_path: Path, state: dict[str, Any]) -> Path:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_trend_is_the_least_squares_change() -> None:
    assert trend([0.0, 1.0, 2.0, 3.0]) == pytest.approx(3.0)
    assert trend([0.5, 0.5, 0.5]) == 0.0
    # One outlier moves a fitted trend less than it moves a first-to-last difference.
    assert abs(trend([0.5, 0.5, 0.5, 0.2])) < 0.3


# ----- config --------------------------------------------------------------------------------------


QUICKSTART = str(REPO_ROOT / "examples" / "quickstart.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("health.entropy_collapse.fraction=0", "health.entropy_collapse.fraction must be in (0, 1]"),
        ("health.patience=0", "health.patience must be >= 1"),
        ("health.reward_hacking.evals=2", "health.reward_hacking.evals must be >= 3"),
        ("health.action=halt", "health.action"),
        ("health.kl_blowup.action=pause", "health.kl_blowup.action"),
    ],
)
def test_bad_health_settings_are_refused_at_load(
    monkeypatch: pytest.MonkeyPatch, override: str, message: str
) -> None:
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        load_config(QUICKSTART, [override])


def test_an_action_for_a_disabled_monitor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    overrides = ["health.kl_blowup.enabled=false", "health.kl_blowup.action=stop"]
    with pytest.raises(ConfigError, match="health.kl_blowup.action=stop does nothing"):
        load_config(QUICKSTART, overrides)


def test_rl_configs_carry_the_health_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    config = load_config("examples/agentic_frozenlake.yaml", ["health.action=stop", "health.window=5"])
    assert config.health.action == "stop" and config.health.window == 5


# ----- the run loop --------------------------------------------------------------------------------


class FakeLoop(RunLoop):
    """A run loop over a synthetic metric stream: no workers, no Ray; checkpoints hold the driver state."""

    def __init__(self, config: RLVRConfig, metrics: list[Metrics], resume_from: Path | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.run_dir = SimpleNamespace(resume_from=resume_from)
        self.budget = RestartBudget(0)
        self.eval_prompts = None
        self.finished = False

    @property
    def total_steps(self) -> int:
        return len(self.metrics)

    def step(self, step: int) -> Metrics:
        self.recent_samples = [{**SAMPLES[0], "step": step}]
        return dict(self.metrics[step - 1])

    def evaluate(self) -> Metrics:
        raise AssertionError("no held-out evaluation in this loop")

    def clusters(self) -> dict:
        return {}

    def trainers(self) -> dict:
        return {}

    def driver_state(self) -> dict[str, Any]:
        return {}

    def load_driver_state(self, state: dict[str, Any]) -> None:
        pass

    def restart_workers(self, lost: dict[str, list[int]]) -> str:
        raise AssertionError("nothing to restart")

    def finish(self, tracker: Any, results: dict[str, float], metrics: dict[str, float]) -> str:
        self.finished = True
        return "done"

    def shutdown(self) -> None:
        pass


def loop_config(output_dir: Path, action: str, log_every: int = 1) -> RLVRConfig:
    config = RLVRConfig(output_dir=str(output_dir), health=HealthConfig(action=action))
    config.tracking.backends = ["jsonl"]
    config.tracking.log_every = log_every
    config.checkpoint.every_steps = 100
    return config


def collapsing_run() -> list[Metrics]:
    return list(stream(from_trouble("actor/entropy", 0.02)))


def test_warn_mode_logs_the_alert_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Metrics are recorded every 7th step only; the step of an alert is recorded anyway.
    assert SMOOTHED_FIRE % 7
    loop = FakeLoop(loop_config(tmp_path, "warn", log_every=7), collapsing_run())
    assert loop.run() == "done"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "health/entropy_collapse" in row] == [SMOOTHED_FIRE]
    assert f"WARNING: health: entropy_collapse at step {SMOOTHED_FIRE}" in capsys.readouterr().out
    dump = json.loads((tmp_path / "health" / f"step_{SMOOTHED_FIRE}_entropy_collapse.json").read_text())
    assert dump["samples"] == [{**SAMPLES[0], "step": SMOOTHED_FIRE}]  # the step's own examples


def test_stop_mode_ends_the_run_with_a_checkpoint_of_the_step(tmp_path: Path) -> None:
    metrics = collapsing_run()
    loop = FakeLoop(loop_config(tmp_path, "stop"), metrics)
    with pytest.raises(HealthStop) as stopped:
        loop.run()
    assert not loop.finished
    message = str(stopped.value)
    saved = checkpoint.checkpoints_root(tmp_path) / checkpoint.step_dir_name(SMOOTHED_FIRE)
    for part in (
        f"entropy_collapse at step {SMOOTHED_FIRE}",
        str(saved),
        f"step_{SMOOTHED_FIRE}_entropy_collapse.json",
        f"roll resume {tmp_path}",
        "health.entropy_collapse.action=warn",
        "health.entropy_collapse.enabled=false",
    ):
        assert part in message
    # Off the checkpoint cadence (every 100 steps), and loadable.
    assert checkpoint.latest_valid(checkpoint.checkpoints_root(tmp_path)) == saved
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == SMOOTHED_FIRE and rows[-1]["health/entropy_collapse"] == 1
    # Resumed from it, the run goes on: the monitor already reported this trouble.
    resumed = FakeLoop(loop_config(tmp_path, "stop"), metrics, resume_from=saved)
    assert resumed.run() == "done"


class SignalledLoop(FakeLoop):
    """Receives SIGTERM after step 3 has run, while its row is being written."""

    def _check_health(self, step: int, metrics: Metrics, tracker: Any) -> list:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before os.kill returns
        return super()._check_health(step, metrics, tracker)


def test_a_stop_signal_after_the_step_still_logs_and_saves_it(tmp_path: Path) -> None:
    config = loop_config(tmp_path, "warn")  # checkpoints every 100 steps: step 3 is off the cadence
    with signals.stop_on_signals(), pytest.raises(signals.StopRequested):
        SignalledLoop(config, [{"actor/entropy": 1.0}] * 10).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3
    last = checkpoint.latest_valid(checkpoint.checkpoints_root(tmp_path))
    assert last is not None and checkpoint.checkpoint_step(last) == 3


def test_roll_train_exits_3_on_a_health_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    import roll.pipelines
    import roll.pipelines.preflight
    from roll.cli import app

    def stopped(*args: Any, **kwargs: Any) -> None:
        raise HealthStop("stopped by the health monitor kl_blowup at step 7")

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(roll.pipelines.preflight, "preflight", lambda config: None)
    monkeypatch.setattr(roll.pipelines, "run_pipeline", stopped)
    result = CliRunner().invoke(app, ["train", "examples/quickstart.yaml"])
    assert result.exit_code == HEALTH_STOP_EXIT_CODE == 3
    assert "roll: stopped by the health monitor kl_blowup at step 7" in result.stderr
