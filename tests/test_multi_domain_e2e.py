"""End to end through `roll train`: examples/rlvr_multi_domain.yaml (math + countdown + code in the
sandbox), shortened, raises the held-out score of at least two domains and logs every domain's metrics."""

from __future__ import annotations

import pytest
from test_pipelines_cli import metrics, roll_train

DOMAINS = ("math", "countdown", "code")


@pytest.mark.slow
def test_the_multi_domain_example_raises_two_domains(repo_root, tmp_path, ray_address):
    """60 RL steps measured held-out gains of +0.14 (math) and +0.15 (countdown), code flat: as much as
    the 80-step run this replaced (+0.12, +0.14) and about three times the 0.05 asked of two domains.
    (40 steps gave only +0.08 and +0.09.)"""
    output_dir = tmp_path / "run"
    overrides = [f"output_dir={output_dir}", "steps=60", "eval.every_steps=30", "tracking.backends=[jsonl]"]
    # On the session's Ray (RAY_ADDRESS), as the other `roll train` tests: no local Ray to start and stop.
    roll_train(repo_root, "examples/rlvr_multi_domain.yaml", *overrides, env={"RAY_ADDRESS": ray_address})
    rows = metrics(output_dir)
    evals = [row for row in rows if "eval/math/score" in row]
    assert [row["step"] for row in evals] == [0, 30, 60]
    gains = {d: evals[-1][f"eval/{d}/score"] - evals[0][f"eval/{d}/score"] for d in DOMAINS}
    assert sum(gain >= 0.05 for gain in gains.values()) >= 2, f"held-out gains by domain: {gains}"
    last = [row for row in rows if "reward/mean" in row][-1]
    for d, share in zip(DOMAINS, (0.4, 0.4, 0.2)):  # ratios 1:1:0.5 of 10 prompts: 4, 4 and 2
        assert last[f"rollout/{d}/frac"] == pytest.approx(share), last
        assert 0.0 <= last[f"reward/{d}/mean"] <= 1.0
    # The rewards' own counters reach the metrics: math-verify's deadline, the sandbox's runs.
    assert last["reward/math/timeout"] == 0.0 and last["reward/code/sandbox_error"] == 0.0
    assert 0.0 <= last["reward/code/passed_frac"] <= 1.0
