"""Short runs of the pipelines covering the paths the quickstart does not take: several PPO mini-batches,
several ranks per role, colocated and disaggregated devices, the hybrid engine, and rewards failing on a
worker or in the controller. The runs that only train run in the test process on the session's Ray
(``train_in_process``): a `roll train` process adds its start-up to each. The command's own path, the exit
codes and messages a user sees, run through `roll train` here (``roll_train``: a failing reward, rows
missing a field) and in the quickstart, FrozenLake, docs-example and agent-program runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def roll_train(
    repo_root: Path,
    config: str,
    *overrides: str,
    env: dict[str, str] | None = None,
    returncode: int = 0,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``roll train`` in a subprocess, as a user runs it (from ``cwd``, default the repo root); asserts
    the exit code. The timeout only guards against a hang: a run beside CPU-bound jobs takes many times
    its quiet-machine time."""
    result = subprocess.run(
        [sys.executable, "-m", "roll.cli", "train", config, *overrides],
        cwd=cwd or repo_root,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=3 * 3600,
    )
    assert result.returncode == returncode, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train_in_process(config: str, *overrides: str) -> None:
    """The pipeline ``config`` names, run in this process (on the session's Ray; from the repo root)."""
    from roll.config.loader import load_config
    from roll.pipelines import run_pipeline

    run_pipeline(load_config(config, list(overrides)))


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# The disaggregated run also takes several PPO mini-batches and epochs (so old logprobs are computed)
# and two reward workers: the multi-rank wiring of every role in one run.
SEVERAL_UPDATES_AND_REWARD_WORKERS = [
    "actor.mini_batch_size=32",
    "actor.ppo_epochs=2",
    "reward=math_verify",  # scored on reward workers (exact_match is scored in the controller)
    "reward_world_size=2",
    "eval.every_steps=2",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "colocated", "extra"),
    [
        # The warm start (two steps) trains on the actor's placements, then hands them to RL.
        ("examples/colocated.yaml", True, ["sft_warm_start.steps=2", "sft_warm_start.batch_size=8"]),
        ("examples/disaggregated.yaml", False, ["sft_warm_start=null", *SEVERAL_UPDATES_AND_REWARD_WORKERS]),
    ],
    ids=["colocated", "disaggregated"],
)
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_device_mapped_examples_train(example, colocated, extra, tmp_path):
    """2 training ranks and 2 rollout workers on logical devices (the session Ray declares 4): colocated
    roles offload between stages, disaggregated ones never do; weights travel over the transfer group.
    Placement, offload and the transfer group exist only in a whole multi-rank run. (A third role on the
    same devices adds only calls that move nothing on a CPU; which roles move when is test_roles'.)"""
    out = tmp_path / "run"
    train_in_process(
        example,
        f"output_dir={out}",
        "steps=2",
        "eval.every_steps=0",
        "eval.max_prompts=16",
        "tracking.backends=[jsonl]",
        "actor.micro_batch_tokens=64",
        *extra,
    )
    rows = [row for row in metrics(out) if "time/step_s" in row]
    assert len(rows) == 2
    for row in rows:
        assert row["sync/gb_per_s"] > 0
        # Logical devices are CPU memory: offloading moves no bytes, but it must happen when colocated.
        assert ("offload/rollout_bytes" in row) == colocated
        assert ("offload/actor_bytes" in row) == colocated
        assert row["rollout/samples"] == 64  # 8 prompts x 8 samples, no padding: roll plot --x samples
        if not colocated:
            # Several updates per batch: old logprobs were computed and the ratio can clip.
            assert row["time/logprobs_s"] > 0.0
            assert 0.0 <= row["actor/clip_frac"] <= 1.0
    if not colocated:
        assert "eval/score" in rows[-1]
    else:
        assert (out / "sft" / "model" / "config.json").is_file()  # the warm start ran on the placements
    assert (out / "model" / "config.json").is_file()


FAILING_REWARD = """
from roll.rewards import REWARD_FUNCTIONS


@REWARD_FUNCTIONS.register("strict_number")  # not inline: scored on reward workers
def strict_number(prompt, response, sample):
    return float(sample["answer"]) - float(sample["answer"])
"""


@pytest.mark.slow
def test_a_reward_failing_on_a_worker_exits_with_an_error_naming_the_rank(repo_root, tmp_path, ray_address):
    """What the user sees on stderr, and the exit code, when the reward fails on a reward worker: needs the
    CLI process and a running pipeline (the remote error crosses Ray, the scheduler and the CLI)."""
    # Rows have an answer, so they load; the reward then fails: the answer is no number.
    rows = tmp_path / "words.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}", "answer": "many"}) + "\n" for i in range(16)))
    (tmp_path / "failing_reward.py").write_text(FAILING_REWARD)
    result = roll_train(
        repo_root,
        str(repo_root / "examples" / "quickstart.yaml"),
        f"output_dir={tmp_path / 'run'}",
        f"data.train_path={rows}",
        "data.eval_path=null",
        "eval.every_steps=0",
        "sft_warm_start=null",
        "imports=[failing_reward]",
        "reward=strict_number",
        "steps=2",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address},
        returncode=1,
        cwd=tmp_path,  # where the plugin is imported from
    )
    assert "error: reward rank 0 failed in compute_rewards()" in result.stderr
    assert "could not convert string to float: 'many'" in result.stderr  # the remote message


def test_a_reward_failing_in_the_controller_exits_with_an_error_naming_its_domain(
    repo_root, tmp_path, monkeypatch
):
    """The same for a reward scored in the controller. The error is the one the reward dispatch raises
    (its text is test_domains'); a whole run adds nothing the worker case above does not show, so the
    pipeline is replaced by one that raises it."""
    from typer.testing import CliRunner

    import roll.pipelines
    from roll.cli import app
    from roll.rewards.scoring import DomainRewards
    from roll.rewards.spec import RewardSpec
    from roll.rollout.backend import RewardDispatch, ScoreJob

    numeric = RewardSpec.single("numeric_match")
    dispatch = RewardDispatch(None, pad_id=0, ranks={}, inline={"default": DomainRewards(numeric, numeric)})

    def run_pipeline(*args: object, **kwargs: object) -> None:
        dispatch.send([ScoreJob("r0", "1+1", "2", {"answer": "many"}, [1], "default")])

    monkeypatch.setattr(roll.pipelines, "run_pipeline", run_pipeline)
    monkeypatch.chdir(repo_root)
    result = CliRunner().invoke(
        app, ["train", "examples/quickstart.yaml", f"output_dir={tmp_path / 'run'}", "reward=numeric_match"]
    )
    assert result.exit_code == 1, result.output
    expected = "error: the reward of domain 'default' (numeric_match) failed in the controller"
    assert expected in result.stderr and "needs a numeric 'answer'" in result.stderr


def test_rows_missing_a_field_the_reward_reads_fail_at_load_naming_file_and_line(repo_root, tmp_path):
    rows = tmp_path / "no_answers.jsonl"
    rows.write_text(
        json.dumps({"prompt": "1+1", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2"}) + "\n"
    )
    result = roll_train(
        repo_root,
        "examples/quickstart.yaml",
        f"output_dir={tmp_path / 'run'}",
        f"data.train_path={rows}",
        "data.eval_path=null",
        "eval.every_steps=0",
        "sft_warm_start=null",
        "model.tiny.hidden_size=16",
        "model.tiny.intermediate_size=32",
        "model.tiny.num_hidden_layers=1",
        "rollout.rollout_batch_size=2",
        "tracking.backends=[jsonl]",
        returncode=2,
    )
    assert f"{rows}:2" in result.stderr and "'answer'" in result.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_hybrid_engine_generates_on_the_actor_ranks(tmp_path):
    """rollout.hybrid_engine: no rollout workers and no weight sync; two FSDP actor ranks generate."""
    out = tmp_path / "hybrid"
    train_in_process(
        "examples/quickstart.yaml",
        f"output_dir={out}",
        "sft_warm_start=null",
        "steps=3",
        "eval.every_steps=3",
        "eval.max_prompts=16",
        "tracking.backends=[jsonl]",
        "rollout.hybrid_engine=true",
        "actor.world_size=2",
    )
    rows = [row for row in metrics(out) if "time/step_s" in row]
    assert len(rows) == 3
    for row in rows:
        assert row["time/rollout_s"] > 0 and row["response/length_mean"] > 0
        assert "time/sync_s" not in row and "sync/gb_per_s" not in row  # nothing to send
    assert "eval/score" in rows[-1]
