"""End to end through the CLI: a shortened quickstart (SFT, then GRPO) runs every stage, logs every
metric and saves its artifacts.

That the quickstart learns is checked on the full run: `.ci/run` runs `roll train
examples/quickstart.yaml` as the README says and requires +0.3 held-out. GRPO raising held-out scores
through `roll train` inside the suite is test_lora's job (GRPO on an adapter, +0.1 held-out); a
1000-step quickstart here repeated it at a large share of the suite's time.

The run is conftest's session fixture ``quickstart_run``: its SFT warm start also starts the LoRA, DPO
and distillation learning tests, so the suite makes that warm start once."""

from __future__ import annotations

import pytest
import yaml
from test_pipelines_cli import metrics


@pytest.mark.slow
def test_shortened_quickstart_runs_every_stage(quickstart_run):
    """The quickstart through `roll train` (SFT warm start, then 30 GRPO steps) runs every stage, logs every
    metric and writes its artifacts: the one end-to-end run of the README's command inside the suite."""
    output_dir, result = quickstart_run  # roll train examples/quickstart.yaml steps=30 eval.every_steps=15

    rows = metrics(output_dir)
    evals = [(row["step"], row["eval/score"]) for row in rows if "eval/score" in row]
    assert [step for step, _ in evals] == [0, 15, 30], evals
    # The warm start learned (a random model scores 0) and RL did not wreck it.
    assert evals[0][1] >= 0.1 and evals[-1][1] >= evals[0][1] - 0.1, evals
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
    # The SFT pipeline learns: the warm start's loss more than halves over its 300 steps and its held-out
    # score rises from 0 (a random model's) by at least 0.1, well below what every seed measured
    # (docs/development.md).
    sft_rows = metrics(output_dir / "sft")
    losses = [row["sft/loss"] for row in sft_rows if "sft/loss" in row]
    warm_start_steps = yaml.safe_load((output_dir / "config.yaml").read_text())["sft_warm_start"]["steps"]
    assert len(losses) == warm_start_steps and losses[-1] < 0.5 * losses[0], losses[::25]
    sft_evals = [row["eval/score"] for row in sft_rows if "eval/score" in row]
    assert sft_evals[-1] >= sft_evals[0] + 0.1, sft_evals
    assert (output_dir / "config.yaml").is_file()
    assert "before RL" in result.stdout
