"""End to end, in the test process on the session's Ray: examples/rlvr_multi_domain.yaml (math +
countdown + code in the sandbox), shortened to two RL steps, routes every domain's samples to its reward
and logs every domain's metrics and held-out scores."""

from __future__ import annotations

import pytest
from test_pipelines_cli import metrics, train_in_process

DOMAINS = ("math", "countdown", "code")


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_the_multi_domain_example_scores_and_logs_every_domain(tmp_path):
    """Two RL steps from the random model (no warm start): every batch holds the domains in their ratios,
    each domain is scored by its own reward (math-verify on a reward worker, countdown in the controller,
    code in the sandbox on its own reward worker) and every domain's training and held-out metrics reach
    metrics.jsonl. Needs a whole run: the three rewards in three places meet only there.

    That the example learns is measured, not asserted here: docs/rewards.md has its runs. RLVR's learning
    is asserted by the quickstart in `.ci/run` and, inside the suite, by test_lora's GRPO run. This test
    was a 60-step learning run with a bar, too long for the suite and too uneven for a bar (docs/rewards.md);
    the routing and metrics it checked are what is left here, and the mix's routing is unit-tested in
    test_domains.py."""
    output_dir = tmp_path / "run"
    overrides = [
        f"output_dir={output_dir}",
        "sft_warm_start=null",
        "steps=2",
        "eval.every_steps=2",
        "eval.max_prompts=16",  # per domain
        "tracking.backends=[jsonl]",
        # One code worker, not the example's two: each costs a process start, and a role's several reward
        # ranks are tested by test_pipelines_cli's disaggregated run.
        "domains.code.reward_world_size=1",
    ]
    train_in_process("examples/rlvr_multi_domain.yaml", *overrides)
    rows = metrics(output_dir)
    evals = [row for row in rows if "eval/score" in row]
    assert [row["step"] for row in evals] == [0, 2]
    for row in evals:
        for d in DOMAINS:
            assert 0.0 <= row[f"eval/{d}/score"] <= 1.0, row
        # eval/score is the domains' scores weighted by their ratios (1 : 1 : 0.5).
        mix = (row["eval/math/score"] + row["eval/countdown/score"] + 0.5 * row["eval/code/score"]) / 2.5
        assert row["eval/score"] == pytest.approx(mix), row
    steps = [row for row in rows if "reward/mean" in row]
    assert len(steps) == 2
    for row in steps:
        for d, share in zip(DOMAINS, (0.4, 0.4, 0.2)):  # ratios 1:1:0.5 of 10 prompts: 4, 4 and 2
            assert row[f"rollout/{d}/frac"] == pytest.approx(share), row
            assert 0.0 <= row[f"reward/{d}/mean"] <= 1.0
        # The rewards' own counters reach the metrics: math-verify's deadline, the sandbox's runs (every
        # code response ran in the sandbox, garbage included, and none failed to start).
        assert row["reward/math/timeout"] == 0.0 and row["reward/code/sandbox_error"] == 0.0
        assert 0.0 <= row["reward/code/passed_frac"] <= 1.0
