"""Tracker.rewind: a resumed run records each step once, with the values of the run that went on."""

from __future__ import annotations

import json
from pathlib import Path

from roll.tracking import Tracker


def read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_jsonl_rewind_drops_the_rows_after_the_step(tmp_path: Path) -> None:
    """Steps 4 and 5 logged, rewound to 3 and logged again: each step once, the new values kept."""
    with Tracker(tmp_path, "demo", total_steps=5, backends=["jsonl"]) as tracker:
        for step in range(6):
            tracker.log(step, {"loss": float(step)})
        tracker.rewind(3)
        assert [row["step"] for row in read_steps(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
        for step in (4, 5):
            tracker.log(step, {"loss": 100.0 + step})

    rows = read_steps(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert [row["loss"] for row in rows] == [0.0, 1.0, 2.0, 3.0, 104.0, 105.0]
    assert not list(tmp_path.glob(".metrics.jsonl*"))  # the rewrite left no staging file


def test_jsonl_rewind_in_a_new_tracker_after_a_restart(tmp_path: Path) -> None:
    """A resumed process opens the old file, rewinds to its checkpoint and appends after it."""
    with Tracker(tmp_path, "demo", total_steps=5, backends=["jsonl"]) as tracker:
        for step in range(1, 6):
            tracker.log(step, {"loss": float(step)})
    with Tracker(tmp_path, "demo", total_steps=5, backends=["jsonl"]) as tracker:
        tracker.rewind(2)
        for step in range(3, 6):
            tracker.log(step, {"loss": -float(step)})

    rows = read_steps(tmp_path / "metrics.jsonl")
    assert [(row["step"], row["loss"]) for row in rows] == [
        (1, 1.0),
        (2, 2.0),
        (3, -3.0),
        (4, -4.0),
        (5, -5.0),
    ]


def test_rewind_to_zero_keeps_only_the_evaluation_before_training(tmp_path: Path) -> None:
    """A restart from the first step keeps step 0 (the evaluation before RL) and nothing after it."""
    with Tracker(tmp_path, "demo", total_steps=3, backends=["jsonl"]) as tracker:
        tracker.log(0, {"eval/score": 0.25})
        tracker.log(1, {"loss": 1.0})
        tracker.rewind(0)
    rows = read_steps(tmp_path / "metrics.jsonl")
    assert [{k: v for k, v in row.items() if k != "time"} for row in rows] == [
        {"step": 0, "eval/score": 0.25}
    ]


def test_tensorboard_rewind_starts_a_new_event_file_that_purges_later_steps(tmp_path: Path) -> None:
    """Rewind does not fail, logging goes on into a new event file, and TensorBoard shows the new values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tensorboard"
    with Tracker(tmp_path, "demo", total_steps=5, backends=["tensorboard"]) as tracker:
        for step in range(6):
            tracker.log(step, {"loss": float(step)})
        before = set(tb_dir.glob("events.out.tfevents.*"))
        tracker.rewind(3)
        for step in (4, 5):
            tracker.log(step, {"loss": 100.0 + step})

    after = set(tb_dir.glob("events.out.tfevents.*"))
    assert len(before) == 1
    assert before < after and len(after) == 2
    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("loss")] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 104.0),
        (5, 105.0),
    ]


def test_rewind_reaches_every_backend(tmp_path: Path) -> None:
    """With both file backends (and the console, which has nothing to rewind) the rewind succeeds."""
    with Tracker(tmp_path, "demo", total_steps=3, backends=["console", "jsonl", "tensorboard"]) as tracker:
        for step in range(1, 4):
            tracker.log(step, {"loss": float(step)})
        tracker.rewind(1)
        tracker.log(2, {"loss": 20.0})
    rows = read_steps(tmp_path / "metrics.jsonl")
    assert [(row["step"], row["loss"]) for row in rows] == [(1, 1.0), (2, 20.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_a_half_written_last_line_is_ended_and_dropped_on_rewind(tmp_path: Path) -> None:
    """A process killed while writing leaves a partial line: the next record still starts a line of its
    own, and a rewind drops the partial one instead of failing the resume."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 0.0}\n{"step": 1, "lo')
    with Tracker(tmp_path, "demo", total_steps=5, backends=["jsonl"]) as tracker:
        tracker.rewind(0)
        tracker.log(1, {"loss": 1.0})
    assert [row["step"] for row in read_steps(tmp_path / "metrics.jsonl")] == [0, 1]
