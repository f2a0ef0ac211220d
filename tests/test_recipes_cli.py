"""Every recipe in examples/recipes runs through ``roll train``; PPO (critic + GAE) and a GRPO-family
recipe run long enough to show the held-out score rising."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_pipelines_cli import metrics, roll_train

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.stem for path in (REPO_ROOT / "examples" / "recipes").glob("*.yaml"))

# What each recipe must log beyond the common metrics: evidence its algorithm really ran.
RECIPE_METRICS = {
    "ppo": ["critic/loss", "critic/explained_variance", "critic/vf_clip_frac", "returns/mean"],
    "reinforce_pp": ["reward/kl", "actor/kl_coef"],
    "dapo": ["reward/shaped_mean"],
}


def ray_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_two_steps(recipe, repo_root, tmp_path, ray_session):
    out = tmp_path / recipe
    roll_train(
        repo_root,
        f"examples/recipes/{recipe}.yaml",
        f"output_dir={out}",
        "steps=2",
        "sft_warm_start.steps=2",
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "tracking.backends=[jsonl]",
        env={"RAY_ADDRESS": ray_address()},
    )
    train_rows = [row for row in metrics(out) if "actor/loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2]
    for row in train_rows:
        for key in ["actor/loss", "actor/grad_norm", "advantages/abs_mean", *RECIPE_METRICS.get(recipe, [])]:
            assert math.isfinite(row[key]), (key, row)
    assert (out / "model" / "config.json").is_file()
    if recipe == "ppo":
        assert (out / "critic" / "config.json").is_file()
