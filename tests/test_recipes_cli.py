"""The recipes in examples/recipes with a code path of their own train two steps, algorithm options
reach the workers, and asynchronous training corrects stale samples. That RLVR learns is shown by the
full quickstart in .ci/run and by test_lora's GRPO run; PPO's gain over 1000 steps is in
docs/algorithms.md (a PPO learning run here cost the suite too much time).

The short runs load the config and run the pipeline in the test process, on the session's Ray: a
``roll train`` subprocess per run would add a process's start-up to each, and the CLI path itself is
tested by the docs example here and by test_pipelines_cli."""

from __future__ import annotations

import math

import pytest
from test_pipelines_cli import metrics, roll_train, train_in_process

# Recipes that take a code path of their own (group filters and extra prompts, several mini-batches and a
# sequence-level loss, KL in the reward with one sample per prompt). grpo, dr_grpo and rloo differ from
# the quickstart only in a registered estimator or aggregation, tested alone in test_algorithms and
# test_algorithm_zoo, and load like every recipe in test_recipes_config. ppo (a critic) runs whole in
# test_resume, which checks its critic's metrics and saved critic.
RUN_RECIPES = ["dapo", "gspo", "reinforce_pp"]


# What each recipe must log beyond the common metrics: evidence its algorithm really ran.
RECIPE_METRICS = {
    "reinforce_pp": ["reward/kl", "actor/kl_coef"],
    "dapo": ["reward/shaped_mean"],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RUN_RECIPES)
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_recipe_trains_two_steps(recipe, tmp_path):
    """Each recipe in examples/recipes runs two RLVR steps and logs evidence that its algorithm ran: a recipe
    is a config, so only running it shows it is consistent."""
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
            ["actor/dual_clip_frac", "actor/tis_weight_mean", "rollout/logprob_diff_max", "actor/kl"],
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
    """Combinations of algorithm options reach the actor's loss, seen in its logged metrics over three
    steps of a real pipeline."""
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


USER_REWARD = """from roll.rewards import REWARD_FUNCTIONS


@REWARD_FUNCTIONS.register("always_a_quarter")  # not inline: scored on reward workers
def always_a_quarter(prompt, response, sample):
    return 0.25
"""


@pytest.mark.slow
def test_docs_example_and_a_users_reward_train_through_the_cli(repo_root, tmp_path, ray_address):
    """The plug-in example in docs/algorithms.md, copied from the page, runs as written, beside a reward
    from another module of the user's: `imports:` loads modules from the working directory of a `roll
    train` process, in the driver (the estimator), the actor (the loss) and the reward workers."""
    page = (repo_root / "docs" / "algorithms.md").read_text()
    code = page.split("```python\n# my_algos.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_algos.py").write_text(code)
    (tmp_path / "my_rewards.py").write_text(USER_REWARD)  # next to the user, not installed anywhere
    out = tmp_path / "run"
    roll_train(
        repo_root,
        str(repo_root / "examples" / "quickstart.yaml"),
        f"output_dir={out}",
        f"data.train_path={repo_root / 'examples/data/addition/train.jsonl'}",
        f"data.eval_path={repo_root / 'examples/data/addition/eval.jsonl'}",
        "imports=[my_algos,my_rewards]",
        "algorithm.advantage_estimator=group_max",
        "algorithm.policy_loss=vanilla_pg",
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
    rows = [row for row in metrics(out) if "actor/loss" in row]
    assert len(rows) == 2
    assert [row["reward/mean"] for row in rows] == [0.25, 0.25]
    # group_max advantages are never positive: the best answer of each group gets 0.
    assert all(row["advantages/mean"] <= 0 for row in rows)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_async_training_corrects_stale_samples_and_says_so(tmp_path, capsys):
    """Asynchronous generation really trains on samples a version old, and the importance weights correct
    them, as the line the run prints says: staleness needs a background rollout over several steps. (With
    the correction off, the warning's text is test_config's, the actor's missing cap test_config_wiring's;
    the actor weighs by the cap only when it has one.)"""
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
        assert row["rollout/logprob_diff_mean"] > 1e-4, row  # the engine/trainer mismatch shows the lag
        assert 0.0 <= row["actor/tis_clip_frac"] <= 1.0
