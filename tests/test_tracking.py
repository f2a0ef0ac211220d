"""Tracker: JSONL records, TensorBoard events, console lines, log_every and lifecycle."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from roll.tracking import TRACKER_BACKENDS, Tracker


def plain_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=80), buffer


def read_jsonl(path: Path) -> list[dict]:
    # json.loads accepts NaN/Infinity by default; reject them so the test checks real JSON.
    def reject(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_registered_backends() -> None:
    assert {"console", "jsonl", "tensorboard"} <= set(TRACKER_BACKENDS.names())


def test_jsonl_lines_hold_step_time_and_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run" / "nested"  # created by the tracker
    with Tracker(out, "demo", total_steps=3, backends=["jsonl"]) as tracker:
        tracker.log(1, {"reward/mean": 0.5, "loss": torch.tensor(1.25), "count": 7})
        tracker.log(2, {"reward/mean": np.float32(0.75), "loss": np.array([2.0])})
        # Flushed per line: readable before close.
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward/mean"] == 0.5 and records[0]["loss"] == 1.25 and records[0]["count"] == 7
    assert records[1]["reward/mean"] == 0.75 and records[1]["loss"] == 2.0
    assert all(isinstance(r["time"], float) for r in records)


def test_jsonl_non_finite_values_are_null(tmp_path: Path) -> None:
    with Tracker(tmp_path, "demo", total_steps=1, backends=["jsonl"]) as tracker:
        tracker.log(
            1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": torch.tensor(float("nan")), "e": 1.0}
        )
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["a"] is None and record["b"] is None and record["c"] is None and record["d"] is None
    assert record["e"] == 1.0


def test_jsonl_rejects_reserved_names_and_non_scalars(tmp_path: Path) -> None:
    with Tracker(tmp_path, "demo", total_steps=1, backends=["jsonl"]) as tracker:
        with pytest.raises(ValueError, match="reserved"):
            tracker.log(1, {"step": 3.0})
        with pytest.raises(TypeError, match="'vec'"):
            tracker.log(1, {"vec": torch.ones(3)})


def test_tensorboard_scalars_and_config(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {"lr": 1e-5, "model": {"path": "tiny"}}
    with Tracker(tmp_path, "demo", total_steps=2, backends=["tensorboard"], config=config) as tracker:
        tracker.log(1, {"reward/mean": 0.25})
        tracker.log(2, {"reward/mean": 0.5, "eval/score": 0.4})
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    rewards = accumulator.Scalars("reward/mean")
    assert [(e.step, e.value) for e in rewards] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, pytest.approx(e.value)) for e in accumulator.Scalars("eval/score")] == [(2, 0.4)]
    assert "config" in "".join(accumulator.Tags()["tensors"])


def test_console_non_terminal_prints_one_line_per_step(tmp_path: Path) -> None:
    console, buffer = plain_console()
    with Tracker(tmp_path, "demo", total_steps=100, backends=["console"], console=console) as tracker:
        tracker.log(10, {"reward/mean": 0.42, "time/step_s": 0.15, "actor/kl": 0.01, "loss": 3.0})
        tracker.log(20, {"eval/score": 0.3, "eval/accuracy": 0.5})
        tracker.log(30, {"reward/mean": 0.5, "actor/entropy": 1.5})
        tracker.print("hello [not markup]")
    lines = buffer.getvalue().splitlines()
    assert lines == [
        "step 10/100 | reward 0.42 | 0.15 s/step | kl 0.01",
        "eval @ step 20: eval/score=0.3, eval/accuracy=0.5",
        "step 30/100 | reward 0.5 | eval 0.3 | entropy 1.5",
        "hello [not markup]",
    ]
    assert "\x1b" not in buffer.getvalue()  # no live-bar escape codes in a log file


def test_console_terminal_draws_bar_with_live_values(tmp_path: Path) -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=160)
    with Tracker(tmp_path, "demo-run", total_steps=4, backends=["console"], console=console) as tracker:
        tracker.log(1, {"reward/mean": 0.42, "time/step_s": 0.15})
        tracker.log(2, {"eval/score": 0.3})
    output = buffer.getvalue()
    assert "demo-run" in output and "2/4" in output
    assert "reward 0.42" in output and "eval 0.3" in output
    assert "eval @ step 2: eval/score=0.3" in output


def test_log_every_skips_steps_except_eval(tmp_path: Path) -> None:
    console, buffer = plain_console()
    with Tracker(
        tmp_path, "demo", total_steps=10, backends=["console", "jsonl"], log_every=5, console=console
    ) as tracker:
        for step in range(1, 11):
            tracker.log(step, {"reward/mean": step / 10})
        tracker.log(7, {"eval/score": 0.9})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [5, 10, 7]
    lines = buffer.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "step 5/10",
        "step 10/10",
        "eval @ step 7: eval/score=0.9",
    ]


def test_unknown_backend_raises_with_suggestion_before_creating_anything(tmp_path: Path) -> None:
    out = tmp_path / "never"
    with pytest.raises(KeyError, match="Did you mean 'tensorboard'"):
        Tracker(out, "demo", total_steps=1, backends=["jsonl", "tensorbord"])
    assert not out.exists()


def test_close_is_idempotent_and_log_after_close_fails(tmp_path: Path) -> None:
    console, _ = plain_console()
    tracker = Tracker(tmp_path, "demo", total_steps=1, console=console)
    tracker.log(1, {"reward/mean": 1.0})
    tracker.close()
    tracker.close()
    with pytest.raises(RuntimeError, match="after close"):
        tracker.log(2, {"reward/mean": 1.0})


def test_invalid_log_every(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="log_every"):
        Tracker(tmp_path, "demo", total_steps=1, backends=[], log_every=0)


def test_console_log_file_gets_about_a_hundred_step_lines_however_long_the_run(tmp_path):
    out = io.StringIO()
    with Tracker(
        tmp_path,
        "long",
        total_steps=1000,
        backends=["console"],
        console=Console(file=out, force_terminal=False),
    ) as tracker:
        for step in range(1, 1001):
            tracker.log(step, {"reward/mean": 0.5})
        tracker.log(1000, {"eval/score": 0.25})
    lines = out.getvalue().splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 100 and step_lines[-1].startswith("step 1000/1000")
    assert "eval @ step 1000: eval/score=0.25" in lines
