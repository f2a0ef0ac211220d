"""Example generations: chosen from a training batch (one per prompt group, padding skipped), recorded to
samples.jsonl every ``samples_every`` steps, and rewound with the metrics on resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from roll.data.batch import Batch
from roll.pipelines.common import example_samples
from roll.tracking import Tracker


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_samples_are_recorded_every_n_steps_and_rewound(tmp_path: Path) -> None:
    with Tracker(tmp_path, "demo", total_steps=6, backends=["jsonl"], samples_every=2) as tracker:
        for step in range(1, 7):
            tracker.log(step, {"loss": 1.0})
            tracker.log_samples(step, [{"prompt": f"p{step}", "response": "r", "reward": float(step)}])
        assert [row["step"] for row in read(tmp_path / "samples.jsonl")] == [2, 4, 6]
        tracker.rewind(3)
        tracker.log_samples(4, [{"prompt": "again", "response": "r", "reward": float("nan")}])
    rows = read(tmp_path / "samples.jsonl")
    assert [(row["step"], row["prompt"]) for row in rows] == [(2, "p2"), (4, "again")]
    assert rows[1]["reward"] is None  # JSON has no NaN


def test_no_samples_file_when_samples_are_off(tmp_path: Path) -> None:
    with Tracker(tmp_path, "demo", total_steps=2, backends=["jsonl"], samples_every=0) as tracker:
        tracker.log(1, {"loss": 1.0})
        tracker.log_samples(1, [{"prompt": "p", "response": "r", "reward": 1.0}])
    assert not (tmp_path / "samples.jsonl").exists()


class Letters:
    """Decodes ids as letters: enough to see which tokens were picked."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_example_samples_take_one_row_per_group_and_skip_padding() -> None:
    batch = Batch(
        tensors={
            "prompt_ids": torch.tensor([[9, 0], [9, 1], [9, 2], [9, 3]]),
            "prompt_mask": torch.tensor([[0, 1], [0, 1], [1, 1], [0, 1]]),
            "response_ids": torch.tensor([[4, 5, 9], [6, 7, 9], [8, 9, 9], [1, 1, 1]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]),
            "group_index": torch.tensor([0, 0, 1, 2]),
            "padding": torch.tensor([False, False, False, True]),
        }
    )
    scores = torch.tensor([0.5, 1.0, 0.0, 7.0])
    rows = example_samples(batch, scores, Letters(), count=5)
    assert rows == [
        {"prompt": "a", "response": "ef", "reward": 0.5, "response_length": 2},
        {"prompt": "jc", "response": "i", "reward": 0.0, "response_length": 1},
    ]
    assert len(example_samples(batch, scores, Letters(), count=1)) == 1
