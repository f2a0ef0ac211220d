"""Algorithm settings at config load: recipes inherit from a base file, and combinations that cannot
work are rejected with a message that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_config import QUICKSTART, REPO_ROOT, load_error

from roll.config import load_config

pytestmark = pytest.mark.usefixtures("at_repo_root")
RECIPES = sorted(path.stem for path in (REPO_ROOT / "examples" / "recipes").glob("*.yaml"))


def test_every_named_recipe_is_shipped() -> None:
    assert set(RECIPES) >= {"ppo", "grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "rloo"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_over_the_quickstart(recipe: str) -> None:
    cfg = load_config(f"examples/recipes/{recipe}.yaml")
    base = load_config(QUICKSTART)
    assert cfg.run_name == recipe and cfg.output_dir == f"runs/recipes/{recipe}"
    # Everything a recipe does not mention comes from its base.
    assert cfg.model == base.model and cfg.data == base.data and cfg.steps == base.steps


def test_recipes_select_their_algorithms() -> None:
    ppo = load_config("examples/recipes/ppo.yaml")
    assert ppo.algorithm.advantage_estimator == "gae" and ppo.critic is not None
    assert ppo.critic.lr == 1e-4 and ppo.critic.world_size == 1
    dr = load_config("examples/recipes/dr_grpo.yaml").algorithm
    assert (dr.advantage_estimator, dr.loss_agg_mode) == ("dr_grpo", "seq-mean-token-sum-norm")
    dapo = load_config("examples/recipes/dapo.yaml")
    assert dapo.algorithm.clip_ratio_high == 0.28 and dapo.algorithm.reward_shaping.overlong_buffer == 2
    # A nested section merges key by key: the base's other rollout keys survive.
    assert dapo.rollout.max_new_tokens == 6 and dapo.rollout.rollout_batch_size == 8
    rpp = load_config("examples/recipes/reinforce_pp.yaml")
    assert rpp.rollout.num_return_sequences == 1 and rpp.algorithm.kl_penalty == "reward"


def test_overrides_apply_over_base_and_recipe() -> None:
    cfg = load_config("examples/recipes/dapo.yaml", ["algorithm.clip_ratio_high=0.3", "steps=7"])
    assert cfg.algorithm.clip_ratio_high == 0.3 and cfg.steps == 7


def test_base_paths_are_relative_to_the_file_and_chain(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text(f"base: {REPO_ROOT / QUICKSTART}\nsteps: 5\nseed: 1\n")
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\nseed: 2\n")
    cfg = load_config(tmp_path / "sub" / "b.yaml")
    assert (cfg.steps, cfg.seed, cfg.run_name) == (5, 2, "quickstart")


def test_missing_base_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: nowhere.yaml\n")
    message = load_error([], str(tmp_path / "a.yaml"))
    assert "base: nowhere.yaml" in message and "does not exist" in message


def test_base_cycle_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert "cycle" in load_error([], str(tmp_path / "a.yaml"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algorithm.advantage_estimator=gae"], ["advantage_estimator=gae needs a value model", "critic:"]),
        (["critic.lr=1e-4"], ["critic", "advantage_estimator=grpo does not use values", "gae"]),
        (["algorithm.advantage_estimator=rloo", "rollout.num_return_sequences=1"], ["rloo", ">= 2"]),
        (
            ["algorithm.advantage_estimator=dr_grp"],
            ["algorithm.advantage_estimator", "Did you mean 'dr_grpo'"],
        ),
        (["algorithm.loss_agg_mode=seq-mean-token-sum-nrm"], ["seq-mean-token-sum-norm"]),
        (["algorithm.kl_penalty=reward"], ["kl_penalty=reward", "kl_coef > 0"]),
        (["algorithm.kl_target=0.01"], ["kl_target", "kl_coef > 0"]),
        (
            ["algorithm.kl_coef=0.1", "algorithm.kl_target=-1"],
            ["algorithm.kl_target must be > 0 (got -1.0)"],
        ),
        (["algorithm.policy_loss=dual_clip", "algorithm.clip_ratio_c=1.0"], ["clip_ratio_c must be > 1"]),
        (["algorithm.tis_cap=0.5"], ["tis_cap must be >= 1"]),
        (
            ["algorithm.tis_cap=2.0"],
            ["algorithm.tis_cap=2.0 is read only when", "algorithm.off_policy_correction=tis"],
        ),
        (
            [
                "rollout.async_generation_ratio=1",
                "algorithm.off_policy_correction=none",
                "algorithm.tis_cap=3",
            ],
            ["algorithm.tis_cap=3.0 is read only when", "off_policy_correction=none makes none"],
        ),
        (["algorithm.clip_ratio_low=1.5"], ["clip_ratio_low must be in (0, 1)"]),
        (["algorithm.lam=1.5"], ["algorithm.lam must be in [0, 1] (got 1.5)"]),
        (["algorithm.reward_shaping.overlong_buffer=9"], ["overlong_buffer (9)", "max_new_tokens=4"]),
        (["algorithm.reward_shaping.clip=0"], ["reward_shaping.clip must be > 0"]),
        (
            ["algorithm.advantage_estimator=gae", "critic.mini_batch_size=12"],
            ["critic.mini_batch_size (12)", "multiple of rollout.num_return_sequences"],
        ),
        (
            ["algorithm.advantage_estimator=gae", "critic.world_size=3"],
            ["(64) must be divisible by critic.world_size (3)"],
        ),
        (["algorithm.advantage_estimator=gae", "critic.lr=0"], ["critic.lr must be > 0"]),
        (
            ["algorithm.advantage_estimator=gae", "critic.model_path=/not/a/model"],
            ["critic.model_path", "/not/a/model"],
        ),
    ],
)
def test_bad_algorithm_combination_is_rejected(overrides: list[str], expected: list[str]) -> None:
    message = load_error(overrides)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_gae_with_a_critic_section_loads() -> None:
    cfg = load_config(QUICKSTART, ["algorithm.advantage_estimator=gae", "critic.lr=1e-4"])
    assert cfg.critic is not None and cfg.critic.value_clip == 0.2


def test_a_user_estimator_with_traits_is_validated_like_a_builtin(monkeypatch) -> None:
    from roll.algorithms import ADVANTAGE_ESTIMATORS
    from roll.algorithms.advantages import grpo_advantages

    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_entries", dict(ADVANTAGE_ESTIMATORS._entries))
    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_traits", dict(ADVANTAGE_ESTIMATORS._traits))
    ADVANTAGE_ESTIMATORS.register("my_group_estimator", needs_groups=True, needs_values=False)(
        grpo_advantages
    )
    overrides = ["algorithm.advantage_estimator=my_group_estimator"]
    assert load_config(QUICKSTART, overrides).algorithm.advantage_estimator == "my_group_estimator"
    assert ">= 2" in load_error([*overrides, "rollout.num_return_sequences=1"])
