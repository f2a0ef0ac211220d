"""End to end through the CLI: a shortened quickstart (SFT, then GRPO) must raise the eval score."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_shortened_quickstart_learns(repo_root, tmp_path):
    output_dir = tmp_path / "run"
    overrides = [
        f"output_dir={output_dir}",
        "steps=1000",
        "eval.every_steps=500",
        "tracking.backends=[jsonl]",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "roll.cli", "train", "examples/quickstart.yaml", *overrides],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(row["step"], row["eval/score"]) for row in rows if "eval/score" in row]
    assert [step for step, _ in evals] == [0, 500, 1000], evals
    before, after = evals[0][1], evals[-1][1]
    assert after >= before + 0.1, f"eval/score did not rise enough: {evals}"
    # Every stage is timed and the run's artifacts exist.
    train_rows = [row for row in rows if "time/step_s" in row]
    for key in (
        "time/rollout_s",
        "rollout/generate_s",
        "rollout/reward_s",
        "time/train_s",
        "time/sync_s",
        "reward/mean",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/clip_frac",
        "throughput/tokens_per_s",
    ):
        assert key in train_rows[-1], key
    assert (output_dir / "model" / "config.json").is_file()
    assert (output_dir / "sft" / "model" / "config.json").is_file()
    assert (output_dir / "config.yaml").is_file()
    assert "before RL" in result.stdout
