"""Short runs of the pipelines through the CLI, covering the paths the quickstart does not take:
a standalone SFT config, KL to a reference, several PPO mini-batches, and several ranks per role."""

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
    the exit code."""
    result = subprocess.run(
        [sys.executable, "-m", "roll.cli", "train", config, *overrides],
        cwd=cwd or repo_root,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == returncode, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_pipeline_learns_and_saves_a_loadable_model(repo_root, tmp_path, ray_address):
    out = tmp_path / "sft"
    roll_train(
        repo_root,
        "examples/sft.yaml",
        f"output_dir={out}",
        "train.steps=200",
        "eval.every_steps=100",
        "eval.max_prompts=100",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address},
    )
    rows = metrics(out)
    losses = [row["sft/loss"] for row in rows if "sft/loss" in row]
    assert len(losses) == 200 and losses[-1] < 0.5 * losses[0], losses[::20]
    assert {row["sft/samples"] for row in rows if "sft/loss" in row} == {64}  # train.batch_size
    assert [row["step"] for row in rows if "eval/score" in row] == [0, 100, 200]

    from roll.models.loading import load_causal_lm, load_tokenizer

    model, tokenizer = load_causal_lm(str(out / "model")), load_tokenizer(str(out / "model"))
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token == "<|eos|>"


@pytest.mark.slow
def test_rlvr_with_kl_minibatches_and_several_ranks_per_role(repo_root, tmp_path, ray_address):
    out = tmp_path / "rlvr"
    roll_train(
        repo_root,
        "examples/quickstart.yaml",
        f"output_dir={out}",
        "sft_warm_start=null",
        "steps=3",
        "eval.every_steps=2",
        "eval.max_prompts=16",
        "tracking.backends=[jsonl]",
        "algorithm.kl_coef=0.05",
        "actor.mini_batch_size=32",
        "actor.micro_batch_size=8",
        "actor.ppo_epochs=2",
        "actor.world_size=2",
        "rollout.world_size=2",
        "reward=math_verify",  # scored on two reward workers (exact_match is scored in the controller)
        "reward_world_size=2",
        env={"RAY_ADDRESS": ray_address},
    )
    rows = [row for row in metrics(out) if "time/step_s" in row]
    assert len(rows) == 3
    for row in rows:
        # The reference ran (KL is logged), and old logprobs were computed (several updates per batch).
        assert row["actor/kl"] >= 0.0
        assert row["time/logprobs_s"] > 0.0
        assert 0.0 <= row["actor/clip_frac"] <= 1.0
        assert row["rollout/samples"] == 64  # 8 prompts x 8 samples, no padding: roll plot --x samples
    assert (out / "model" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "colocated"), [("examples/colocated.yaml", True), ("examples/disaggregated.yaml", False)]
)
def test_device_mapped_examples_train(example, colocated, repo_root, tmp_path, ray_address):
    """2 training ranks and 2 rollout workers on logical devices (the session Ray declares 4): colocated
    roles offload between stages, disaggregated ones never do; weights travel over the transfer group."""
    out = tmp_path / "run"
    roll_train(
        repo_root,
        example,
        f"output_dir={out}",
        "sft_warm_start=null",
        "steps=2",
        "eval.every_steps=0",
        "eval.max_prompts=16",
        "tracking.backends=[jsonl]",
        "algorithm.kl_coef=0.05",  # a reference model on the actor's devices too
        "actor.micro_batch_tokens=64",
        env={"RAY_ADDRESS": ray_address},
    )
    rows = [row for row in metrics(out) if "time/step_s" in row]
    assert len(rows) == 2
    for row in rows:
        assert row["sync/gb_per_s"] > 0
        # Logical devices are CPU memory: offloading moves no bytes, but it must happen when colocated.
        assert ("offload/rollout_bytes" in row) == colocated
        assert ("offload/actor_bytes" in row) is True  # the reference and the actor share devices
    assert (out / "model" / "config.json").is_file()


FAILING_REWARD = """
from roll.rewards import REWARD_FUNCTIONS


@REWARD_FUNCTIONS.register("strict_number")  # not inline: scored on reward workers
def strict_number(prompt, response, sample):
    return float(sample["answer"]) - float(sample["answer"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["worker", "controller"])
def test_a_failing_reward_exits_with_an_error_naming_where_it_failed(repo_root, tmp_path, ray_address, where):
    # Rows have an answer, so they load; the reward then fails: the answer is no number.
    rows = tmp_path / "words.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}", "answer": "many"}) + "\n" for i in range(16)))
    (tmp_path / "failing_reward.py").write_text(FAILING_REWARD)
    on_workers = ["imports=[failing_reward]", "reward=strict_number"]
    reward = on_workers if where == "worker" else ["reward=numeric_match"]
    result = roll_train(
        repo_root,
        str(repo_root / "examples" / "quickstart.yaml"),
        f"output_dir={tmp_path / 'run'}",
        f"data.train_path={rows}",
        "data.eval_path=null",
        "eval.every_steps=0",
        "sft_warm_start=null",
        *reward,
        "steps=2",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address},
        returncode=1,
        cwd=tmp_path,  # where the plugin is imported from
    )
    if where == "worker":
        assert "error: reward rank 0 failed in compute_rewards()" in result.stderr
        assert "could not convert string to float: 'many'" in result.stderr  # the remote message
    else:
        expected = "error: the reward of domain 'default' (numeric_match) failed in the controller"
        assert expected in result.stderr
        assert "needs a numeric 'answer'" in result.stderr


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
def test_a_reward_from_the_users_own_module_runs_on_the_workers(repo_root, tmp_path, ray_address):
    # A module next to the user (the working directory), not installed anywhere.
    (tmp_path / "my_rewards.py").write_text(
        "from roll.rewards import REWARD_FUNCTIONS\n\n\n"
        '@REWARD_FUNCTIONS.register("always_a_quarter")\n'
        "def always_a_quarter(prompt, response, sample):\n"
        "    return 0.25\n"
    )
    out = tmp_path / "run"
    data = repo_root / "examples" / "data" / "addition"
    roll_train(
        repo_root,
        str(repo_root / "examples" / "quickstart.yaml"),
        f"output_dir={out}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'eval.jsonl'}",
        "imports=[my_rewards]",
        "reward=always_a_quarter",
        "eval_reward=exact_match",
        "sft_warm_start=null",
        "steps=2",
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address},
        cwd=tmp_path,
    )
    rows = [row for row in metrics(out) if "reward/mean" in row]
    assert [row["reward/mean"] for row in rows] == [0.25, 0.25]


@pytest.mark.slow
def test_hybrid_engine_generates_on_the_actor_ranks(repo_root, tmp_path, ray_address):
    """rollout.hybrid_engine: no rollout workers and no weight sync; two FSDP actor ranks generate."""
    out = tmp_path / "hybrid"
    roll_train(
        repo_root,
        "examples/quickstart.yaml",
        f"output_dir={out}",
        "sft_warm_start=null",
        "steps=3",
        "eval.every_steps=3",
        "eval.max_prompts=16",
        "tracking.backends=[jsonl]",
        "rollout.hybrid_engine=true",
        "actor.world_size=2",
        env={"RAY_ADDRESS": ray_address},
    )
    rows = [row for row in metrics(out) if "time/step_s" in row]
    assert len(rows) == 3
    for row in rows:
        assert row["time/rollout_s"] > 0 and row["response/length_mean"] > 0
        assert "time/sync_s" not in row and "sync/gb_per_s" not in row  # nothing to send
    assert "eval/score" in rows[-1]
