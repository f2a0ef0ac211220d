"""Exact resume: a run stopped after step k and resumed from its checkpoint logs the same metrics at every
later step as the run that never stopped (CPU, fixed seeds), for RLVR (PPO: actor
and critic) and for SFT. Each step appears once in metrics.jsonl.

The "stopped" run is the finished run's directory with everything after step k removed, as a crash right
after the checkpoint of step k leaves it; it then resumes with ``resume="latest"``. The runs use the test
session's Ray, in this process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from roll import checkpoint
from roll.config.loader import ConfigError, load_config
from roll.pipelines import run_pipeline

# Wall times and throughputs differ between any two runs; everything else must not.
TIMING = ("time/", "throughput/", "sync/gb_per_s", "eval/time_s", "rollout/queue_s", "rollout/generate_s")
TIMING += ("rollout/reward_s", "rollout/ready_wait_s")


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith(TIMING)} for row in rows]


# The engine/trainer mismatch is rounding (1e-7 here): its exact value follows how a worker's threads split
# the sums, which a fresh process may do otherwise (with two threads per worker, as `pytest tests/x.py`
# alone gives them). Engine weights that were not the trained ones would put it above 1e-3.
ROUNDING = ("rollout/logprob_diff",)


def same(key: str, a: object, b: object) -> bool:
    if key.startswith(ROUNDING) and isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6
    return a == b


def assert_same_rows(got: list[dict], expected: list[dict]) -> None:
    """The rows equal but for timings (and rounding); a failure names each metric that differs, with both
    values."""
    got, expected = comparable(got), comparable(expected)
    differ = [
        (row.get("step"), key, row.get(key), other.get(key))
        for row, other in zip(got, expected)
        for key in sorted(set(row) | set(other))
        if not same(key, row.get(key), other.get(key))
    ]
    assert len(got) == len(expected) and not differ, differ


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def crash_after(finished: Path, stopped: Path, step: int) -> None:
    """``stopped`` = ``finished`` as a crash right after the checkpoint of ``step`` would leave it: later
    checkpoints, the final model and later metric rows absent (a resumed run cuts extra rows itself)."""
    shutil.copytree(finished, stopped)
    for later, path in checkpoint.list_checkpoints(checkpoint.checkpoints_root(stopped)):
        if later > step:
            shutil.rmtree(path)
    shutil.rmtree(stopped / "model")


RLVR_RUN = (
    "steps=4",
    "sft_warm_start.steps=40",  # rewards that differ, so the updates are not all zero
    "eval.every_steps=2",
    "eval.max_prompts=32",
    "checkpoint.every_steps=2",
    "tracking.backends=[jsonl]",
)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_rlvr_resumed_run_matches_the_uninterrupted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A PPO run (actor, critic, their optimizers, the warm start, the data order and RNGs) stopped after
    step 2 and resumed from its checkpoint logs exactly what an uninterrupted run logs: full-state resume
    is only visible across two whole runs. Both go through the commands' own functions in this process:
    `roll train`, then `roll resume RUN_DIR` (the command a stopped run names, test_run_control), which
    reads the run's saved config. GRPO's state is PPO's without the critic, so one run covers
    both. It is also the run of the PPO recipe (test_recipes_cli runs the others): its critic's metrics
    are logged and its critic is saved."""
    from roll.cli import resume_run, train

    config = "examples/recipes/ppo.yaml"
    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    train(config, [*RLVR_RUN, f"output_dir={finished}"], resume=None, overwrite=False)
    crash_after(finished, stopped, 2)
    last = checkpoint.latest_valid(checkpoint.checkpoints_root(stopped))
    capsys.readouterr()
    resume_run(str(stopped), [])  # the run's saved config (it names finished/ as its output_dir)
    assert f"resumed from {last} after step 2" in capsys.readouterr().out

    expected, got = metrics(finished), metrics(stopped)
    assert [row["step"] for row in got] == list(range(0, 5))
    assert_same_rows(got, expected)
    assert any(row["actor/grad_norm"] > 0 for row in expected[3:]), "no update after the resume point"
    for row in got[1:]:
        for key in ["critic/loss", "critic/explained_variance", "critic/vf_clip_frac", "returns/mean"]:
            assert math.isfinite(row[key]), (key, row)
    assert (stopped / "model" / "config.json").is_file()
    assert (stopped / "critic" / "config.json").is_file()
    # The warm start was not run again: its metrics still end where the first run left them.
    assert metrics(stopped / "sft") == metrics(finished / "sft")


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_sft_resumed_run_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    """examples/sft.yaml through `roll train` (the command's function, in this process: its own model,
    data, schedule and evaluation, and a model plain loading reads), then stopped after step 4 and resumed
    from its checkpoint: the same metrics as the uninterrupted run. Needs two whole runs. That the SFT
    pipeline learns (its loss more than halves, held-out rises from 0) is asserted on the quickstart's warm
    start, the same pipeline (test_quickstart_e2e)."""
    from roll.cli import train

    run = ("train.steps=8", "eval.every_steps=4", "eval.max_prompts=32", "checkpoint.every_steps=4")
    run += ("tracking.backends=[jsonl]",)
    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    train("examples/sft.yaml", [*run, f"output_dir={finished}"], resume=None, overwrite=False)
    expected = metrics(finished)
    losses = [row["sft/loss"] for row in expected if "sft/loss" in row]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert {row["sft/samples"] for row in expected if "sft/loss" in row} == {64}  # train.batch_size
    assert [row["step"] for row in expected if "eval/score" in row] == [0, 4, 8]
    from roll.models.loading import load_causal_lm, load_tokenizer

    model, tokenizer = load_causal_lm(str(finished / "model")), load_tokenizer(str(finished / "model"))
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token == "<|eos|>"

    crash_after(finished, stopped, 4)
    run_pipeline(load_config("examples/sft.yaml", [*run, f"output_dir={stopped}"]), resume="latest")
    got = metrics(stopped)
    assert [row["step"] for row in got] == list(range(0, 9))
    assert_same_rows(got, expected)


@pytest.mark.usefixtures("at_repo_root")
def test_a_second_run_into_a_run_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    config = load_config("examples/quickstart.yaml", [f"output_dir={out}", "tracking.backends=[jsonl]"])
    with pytest.raises(ConfigError, match="already holds a run.*--overwrite"):
        run_pipeline(config)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (out / "config.yaml").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_a_standby_rollout_worker_takes_over_a_lost_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``checkpoint.standby_workers``: an idle, warmed-up rollout cluster waits beside the live one; when
    the live one is killed, the standby becomes the rollout cluster (no process to start) and a new
    standby is made for the next loss. Each step is still logged once."""
    import logging
    import os
    import signal

    from roll.pipelines.rlvr import RLVRPipeline

    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "sft_warm_start=null", "data.eval_path=null", "eval.every_steps=0"]
    overrides += ["steps=3", "checkpoint.standby_workers=true", "tracking.backends=[jsonl]"]
    pipeline = RLVRPipeline(load_config("examples/quickstart.yaml", overrides))
    try:
        standby = pipeline.role_set.standbys["rollout"]
        # exact_match is scored in the controller: the run has no reward workers to keep a standby of
        assert set(pipeline.role_set.standbys) == {"actor", "rollout"}
        (live,) = pipeline.rollout.ping()
        os.kill(live["pid"], signal.SIGKILL)
        with caplog.at_level(logging.WARNING):
            pipeline._train()
        assert pipeline.rollout is standby and pipeline.budget.restarts == 1
        assert pipeline.role_set.standbys["rollout"] is not standby  # a new one waits for the next loss
        assert "replaced the rollout workers" in caplog.text and "(standby processes)" in caplog.text
    finally:
        pipeline.shutdown()
    assert [row["step"] for row in metrics(out)] == [1, 2, 3]
