"""The shell SFT, DPO and offline distillation share (``TrainerPipeline``), on a fake trainer: no Ray, no
model. What each pipeline adds runs whole in test_pipelines_cli, test_dpo and test_distill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import roll.pipelines.trainer_pipeline as shell
from roll.config import load_config
from roll.distributed.errors import WorkerError
from roll.pipelines.preflight import RunInputs
from roll.pipelines.roles import Role
from roll.pipelines.trainer_pipeline import TrainerPipeline


class FakeTrainer:
    """Stands in for the ``actor`` cluster: dies in the call of ``die_at_step`` (once), like a SIGKILLed
    rank whose loss the next probe finds."""

    def __init__(self, die_at_step: int | None):
        self.die_at_step, self.dead, self.killed = die_at_step, False, False

    def train(self, step: int) -> None:
        if step == self.die_at_step:
            self.dead = True
            raise WorkerError("actor", 0, "train_step", "the worker died")

    def lost_ranks(self) -> list[int]:
        return [0] if self.dead else []

    def kill(self) -> None:
        self.killed = True

    def save_pretrained(self, path: str, dtype: str | None = None) -> str:
        return path


class RecordingPipeline(TrainerPipeline):
    """Trains on nothing; records the rows each step draws."""

    name = "test"

    def read_inputs(self, inputs: RunInputs) -> None:
        self.train_rows, self.eval_prompts = inputs.train, None
        self.drawn: list[list[int]] = []
        self.started: list[FakeTrainer] = []

    def roles(self) -> dict[str, Role]:
        return {"actor": Role("actor", FakeTrainer, 1, None, trainer=True)}

    def start_workers(self) -> None:
        # The first trainer dies in step 3; the one that replaces it lives.
        trainer = FakeTrainer(die_at_step=3 if not self.started else None)
        self.started.append(trainer)
        self.role_set.roles = self.roles()
        self.role_set.live["actor"] = trainer  # type: ignore[assignment]

    def step(self, step: int) -> dict[str, float]:
        indices = self.order.next_indices()
        self.actor.train(step)  # type: ignore[attr-defined]
        self.drawn.append(indices)
        return {"sft/loss": 0.0}

    def evaluate(self) -> dict[str, float]:
        return {}


def test_a_trainer_lost_before_any_checkpoint_restarts_the_run_on_the_same_rows(
    tmp_path: Path, at_repo_root: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing saved yet: the run starts over, so it must draw the rows an uninterrupted run draws (a
    data order that kept going would train steps 1 and 2 again on other rows)."""
    monkeypatch.setattr(shell, "init_ray", lambda ray: None)
    overrides = [f"output_dir={tmp_path}", "train.steps=4", "train.batch_size=4", "checkpoint.every_steps=0"]
    overrides += [
        "checkpoint.max_restarts=1",
        "tracking.backends=[jsonl]",
        "data.eval_path=null",
        "eval.every_steps=0",
    ]
    pipeline = RecordingPipeline(load_config("examples/sft.yaml", overrides))
    pipeline.run()

    first, replacement = pipeline.started
    assert first.killed and replacement.killed  # the lost trainer at the restart, the other at the end
    # Steps 1 and 2, then steps 1-4 again from the start of the order.
    assert len(pipeline.drawn) == 6 and pipeline.drawn[2:4] == pipeline.drawn[:2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[-1]["recovery/restarts"] == 1


def test_the_warm_start_hands_rl_its_float32_weights(monkeypatch) -> None:
    """The RL warm start saves SFT's float32 master weights (not a copy rounded to model.dtype), so RL's
    first step starts from what SFT trained; a plain SFT run saves in model.dtype."""
    from roll.config.loader import load_config
    from roll.pipelines import sft

    monkeypatch.setattr(sft.SFTPipeline, "__init__", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(sft.SFTPipeline, "run", lambda self: self.saved_dtype)
    rl = load_config("examples/quickstart.yaml", ["model.dtype=bfloat16"])
    warm = rl.sft_warm_start
    assert sft.sft_warm_start(rl, "/models/base", None, None, warm) == "float32"
    assert sft.SFTPipeline.saved_dtype is None
