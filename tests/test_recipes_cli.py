"""Every recipe in examples/recipes trains; PPO (critic + GAE) and a GRPO-family recipe run long enough
through ``roll train`` to show the held-out score rising.

The two-step smoke runs load the config and run the pipeline in the test process, on the session's Ray:
a ``roll train`` subprocess per run would add about 5 s of start-up each, and the CLI path itself is
tested by the long runs here and by test_pipelines_cli."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_pipelines_cli import metrics, roll_train

from roll.config.loader import load_config
from roll.pipelines.rlvr import RLVRPipeline

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.stem for path in (REPO_ROOT / "examples" / "recipes").glob("*.yaml"))


def train_in_process(config: str, *overrides: str) -> None:
    """Load ``config`` with ``overrides`` and run its RLVR pipeline here (the caller is at the repo root)."""
    RLVRPipeline(load_config(config, overrides)).run()


# What each recipe must log beyond the common metrics: evidence its algorithm really ran.
RECIPE_METRICS = {
    "ppo": ["critic/loss", "critic/explained_variance", "critic/vf_clip_frac", "returns/mean"],
    "reinforce_pp": ["reward/kl", "actor/kl_coef"],
    "dapo": ["reward/shaped_mean"],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_recipe_trains_two_steps(recipe, tmp_path):
    out = tmp_path / recipe
    train_in_process(
        f"examples/recipes/{recipe}.yaml",
        f"output_dir={out}",
        "steps=2",
        "sft_warm_start=null",  # the warm start is the quickstart's, tested there
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "tracking.backends=[jsonl]",
    )
    train_rows = [row for row in metrics(out) if "actor/loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2]
    for row in train_rows:
        for key in ["actor/loss", "actor/grad_norm", "advantages/abs_mean", *RECIPE_METRICS.get(recipe, [])]:
            assert math.isfinite(row[key]), (key, row)
    assert (out / "model" / "config.json").is_file()
    if recipe == "ppo":
        assert (out / "critic" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "expected_metrics"),
    [
        (
            # Dual-clip with truncated IS, two updates per batch, and an adaptive KL in the loss.
            [
                "algorithm.policy_loss=dual_clip",
                "algorithm.off_policy_correction=tis",
                "actor.mini_batch_size=32",
                "algorithm.kl_coef=0.05",
                "algorithm.kl_target=0.001",
                "algorithm.kl_horizon=100",
            ],
            ["actor/dual_clip_frac", "actor/tis_weight_mean", "actor/kl", "actor/kl_coef"],
        ),
        (
            # CISPO with KL in the reward, REINFORCE++-baseline advantages and reward shaping.
            [
                "algorithm.policy_loss=cispo",
                "algorithm.advantage_estimator=reinforce_plus_plus_baseline",
                "algorithm.kl_coef=0.05",
                "algorithm.kl_penalty=reward",
                "algorithm.reward_shaping.length_penalty_coef=0.1",
                "algorithm.reward_shaping.normalize=true",
                "algorithm.reward_shaping.clip=2.0",
            ],
            ["reward/kl", "reward/shaped_mean", "actor/clip_frac"],
        ),
    ],
    ids=["dual_clip_tis_adaptive_kl", "cispo_kl_in_reward_shaping"],
)
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_algorithm_knobs_reach_the_workers(overrides, expected_metrics, tmp_path):
    out = tmp_path / "run"
    train_in_process(
        "examples/quickstart.yaml",
        f"output_dir={out}",
        "sft_warm_start=null",
        "steps=3",
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "tracking.backends=[jsonl]",
        *overrides,
    )
    rows = [row for row in metrics(out) if "actor/loss" in row]
    assert len(rows) == 3
    for key in expected_metrics:
        assert all(math.isfinite(row[key]) for row in rows), key
    if "algorithm.kl_target=0.001" in overrides:
        # The adaptive controller moves the coefficient every step.
        coefs = [row["actor/kl_coef"] for row in rows]
        assert coefs[0] == 0.05 and len(set(coefs)) == 3, coefs


@pytest.mark.slow
def test_docs_example_estimator_and_loss_train_through_the_cli(repo_root, tmp_path, ray_address):
    """The plug-in example in docs/algorithms.md, copied from the page, runs as written."""
    page = (repo_root / "docs" / "algorithms.md").read_text()
    code = page.split("```python\n# my_algos.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_algos.py").write_text(code)
    out = tmp_path / "run"
    roll_train(
        repo_root,
        str(repo_root / "examples" / "quickstart.yaml"),
        f"output_dir={out}",
        f"data.train_path={repo_root / 'examples/data/addition/train.jsonl'}",
        f"data.eval_path={repo_root / 'examples/data/addition/eval.jsonl'}",
        "imports=[my_algos]",
        "algorithm.advantage_estimator=group_max",
        "algorithm.policy_loss=vanilla_pg",
        "sft_warm_start=null",
        "steps=2",
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address},
        cwd=tmp_path,
    )
    rows = [row for row in metrics(out) if "actor/loss" in row]
    assert len(rows) == 2
    # group_max advantages are never positive: the best answer of each group gets 0.
    assert all(row["advantages/mean"] <= 0 for row in rows)


@pytest.mark.slow
# One learning run per family beyond GRPO's, which test_multi_domain_e2e (and the full quickstart in
# .ci/run) cover; an RLOO run here repeated it at 90 s of the suite's 15 minutes.
@pytest.mark.parametrize(("recipe", "steps", "min_gain"), [("ppo", 250, 0.07)])
def test_recipe_raises_the_held_out_score(
    recipe, steps, min_gain, quickstart_warm_start, repo_root, tmp_path, ray_address
):
    """PPO (critic + GAE) learns from the quickstart's warm start (docs/algorithms.md: +0.13 by step
    1000 of 3000). This 250-step run measured 0.14 -> 0.20 at step 125 and 0.275 at 250 (+0.135; the
    500-step run it replaced, 0.34 at 500 against a +0.1 bar): the bar is half the measured gain, as it
    was. The warm start is the session's (conftest's ``quickstart_warm_start``), shared with the
    quickstart and LoRA tests."""
    out = tmp_path / recipe
    roll_train(
        repo_root,
        f"examples/recipes/{recipe}.yaml",
        f"output_dir={out}",
        f"model.path={quickstart_warm_start}",
        "model.tiny=null",
        "sft_warm_start=null",
        f"steps={steps}",
        f"eval.every_steps={steps // 2}",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address},
    )
    evals = [(row["step"], row["eval/score"]) for row in metrics(out) if "eval/score" in row]
    assert [step for step, _ in evals] == [0, steps // 2, steps]
    before, after = evals[0][1], evals[-1][1]
    assert after >= before + min_gain, f"{recipe}: eval/score did not rise enough: {evals}"


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_async_training_corrects_stale_samples_and_says_so(tmp_path, capsys):
    common = ["steps=4", "sft_warm_start=null", "eval.every_steps=0", "tracking.backends=[jsonl]"]
    # From the random model every reward is 0: an entropy bonus and a high learning rate still move the
    # policy visibly at every step.
    moving = ["actor.lr=1e-2", "algorithm.entropy_coef=0.01"]
    train_in_process("examples/async.yaml", f"output_dir={tmp_path / 'on'}", *moving, *common)
    assert "off-policy correction (rollout.async_generation_ratio=1)" in capsys.readouterr().out
    rows = [row for row in metrics(tmp_path / "on") if "actor/loss" in row]
    stale = [row for row in rows if row["rollout/staleness_mean"] > 0]
    assert stale, [row["rollout/staleness_mean"] for row in rows]
    for row in stale:  # samples a version old: the trainer's and the engine's probabilities differ
        assert abs(row["actor/tis_weight_mean"] - 1.0) > 1e-4, row
        assert 0.0 <= row["actor/tis_clip_frac"] <= 1.0

    off = ["algorithm.off_policy_correction=none", "steps=2"]
    train_in_process("examples/async.yaml", f"output_dir={tmp_path / 'off'}", *common, *off)
    assert "WARNING: off-policy correction is off" in capsys.readouterr().out
    assert not any("actor/tis_weight_mean" in row for row in metrics(tmp_path / "off"))
