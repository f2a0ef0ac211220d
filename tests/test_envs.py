"""Environments alone (no model, no Ray): reset/step semantics, seeded determinism, held-out seeds kept
apart by task, the format penalty, the registry's option checks and the generic Gymnasium adapter."""

from __future__ import annotations

import io
import itertools

import gymnasium
import pytest
from PIL import Image

from roll.envs import ENVIRONMENTS, check_env, make_env
from roll.envs.agents import ConstantAgent, FrozenLakeExpert, RandomAgent, play
from roll.envs.base import ImageObservation
from roll.envs.frozen_lake import ACTIONS, CELL_PIXELS, COLOURS, FrozenLake, shortest_path
from roll.envs.gym_adapter import GymnasiumTextEnv
from roll.envs.seeds import held_out_seeds, training_seeds


def test_a_seed_is_a_task_the_same_every_time() -> None:
    env = FrozenLake(size=4)
    first, _ = env.reset(7)
    assert first == FrozenLake(size=4).reset(7)[0]
    assert first.count("P") == 1 and first.count("G") == 1 and len(first.split("\n")) == 4
    maps = {env.reset(seed)[0] for seed in range(20)}
    assert len(maps) > 10  # seeds make different maps


def test_moves_holes_and_the_goal() -> None:
    env = FrozenLake(size=4)
    seed = next(s for s in range(100) if env.layout(s).split("\n")[0].startswith("SH"))  # a hole to the right
    env.reset(seed)
    observation, reward, terminated, truncated, info = env.step("D")  # off the start, onto ice or a hole
    if not terminated:
        assert observation.split("\n")[1][0] == "P" and reward == 0.0
    env.reset(seed)
    _, reward, terminated, _, info = env.step(" r ")  # case and spaces ignored: into the hole
    assert terminated and reward == 0.0 and info["action_is_valid"] and info["metrics"] == {"success": 0.0}
    path = shortest_path(env.reset(seed)[0])
    assert path is not None
    for letter in path[:-1]:
        assert env.step(letter)[2] is False
    _, reward, terminated, truncated, info = env.step(path[-1])
    assert (reward, terminated, truncated, info["metrics"]["success"]) == (1.0, True, False, 1.0)


def test_a_malformed_action_costs_the_format_penalty_and_the_episode_goes_on() -> None:
    env = FrozenLake(size=4, invalid_action_reward=-0.5)
    start, _ = env.reset(3)
    for text in ("", "left", "LR", "X"):
        observation, reward, terminated, truncated, info = env.step(text)
        assert (reward, terminated, truncated, info["action_is_valid"]) == (-0.5, False, False, False)
        assert observation.startswith("Invalid action. Answer with one letter: L, D, R or U.")
        assert observation.endswith(start)  # the player did not move
    assert env.step(shortest_path(start)[0])[4]["action_is_valid"]


def test_a_map_rendered_as_a_picture_shows_each_cell_in_its_square_and_keeps_the_grid_as_state() -> None:
    pictured, text = FrozenLake(size=4, render="image"), FrozenLake(size=4)
    observation, _ = pictured.reset(3)
    grid, _ = text.reset(3)
    assert isinstance(observation, ImageObservation) and observation.state == grid and observation.text == ""
    picture = Image.open(io.BytesIO(observation.images[0]))
    assert picture.size == (4 * CELL_PIXELS, 4 * CELL_PIXELS)
    for r, row in enumerate(grid.split("\n")):
        for c, cell in enumerate(row):
            centre = (c * CELL_PIXELS + CELL_PIXELS // 2, r * CELL_PIXELS + CELL_PIXELS // 2)
            assert picture.getpixel(centre) == COLOURS[cell], (r, c, cell)
    # The expert reads the state behind the picture; a move changes the picture; a bad turn keeps it.
    assert FrozenLakeExpert().act(observation) == shortest_path(grid)[0]
    moved = pictured.step(shortest_path(grid)[0])[0]
    assert moved.state == text.step(shortest_path(grid)[0])[0] and moved.images != observation.images
    invalid = pictured.step("X")[0]
    assert invalid.images == moved.images and invalid.text.startswith(
        "Invalid action. Answer with one letter"
    )
    assert check_env("env", "frozen_lake", {"render": "video"})[0].endswith(
        "render must be one of text, image, got 'video'"
    )


def test_slippery_moves_follow_gymnasium_and_the_seed() -> None:
    env = FrozenLake(size=4, slippery=True, success_rate=0.0)  # never the intended way
    env.reset(5)
    moved = [env.step("R")[0] for _ in range(3)]
    env.reset(5)
    assert [env.step("R")[0] for _ in range(3)] == moved  # the seed fixes the slips too


def test_the_expert_solves_every_map_and_the_baselines_rarely_do() -> None:
    env = FrozenLake(size=4)
    seeds = range(40)
    expert = [play(env, FrozenLakeExpert(), s, max_turns=8) for s in seeds]
    assert all(e.success and e.stop_reason == "env_done" for e in expert)
    assert all(len(e.actions) == len(shortest_path(e.observations[0])) for e in expert)
    noisy = sum(play(env, FrozenLakeExpert(noise=0.3, seed=s), s, 8).success for s in seeds) / len(seeds)
    randomly = sum(play(env, RandomAgent(ACTIONS, seed=s), s, 8).success for s in seeds) / len(seeds)
    always_down = sum(play(env, ConstantAgent("D"), s, 8).success for s in seeds) / len(seeds)
    assert randomly < noisy < 1.0 and always_down < noisy
    stuck = play(env, ConstantAgent("U"), 0, max_turns=3)  # walks into the top wall for ever
    assert stuck.stop_reason == "max_turns" and len(stuck.actions) == 3 and not stuck.success


def test_training_never_sees_a_held_out_map() -> None:
    env = FrozenLake(size=4)
    held_out = {env.layout(s) for s in held_out_seeds(50)}
    train = list(itertools.islice(training_seeds(env, held_out=50), 300))
    assert min(train) >= 50 and len(set(train)) == 300
    assert not held_out & {env.layout(s) for s in train}
    collisions = [s for s in range(50, max(train)) if env.layout(s) in held_out]
    assert collisions  # 4x4 maps repeat across seeds: without the check these would be trained on
    assert list(itertools.islice(training_seeds(env, 50, start=100), 5)) == train[100:105]  # resumable


def test_env_options_are_checked_at_load() -> None:
    assert check_env("env", "frozen_lake", {"size": 4, "slippery": True}) == []
    (typo,) = check_env("env", "frozen_lak", {})
    assert "unknown environment 'frozen_lak'" in typo and "Did you mean 'frozen_lake'" in typo
    (option,) = check_env("env", "frozen_lake", {"sise": 4})
    assert "environment 'frozen_lake' has no option 'sise'. Did you mean 'size'?" in option
    (value,) = check_env("env.options", "frozen_lake", {"size": 1})
    assert value.startswith("env.options: environment 'frozen_lake': size must be an integer from 2 to 32")
    assert check_env("env", "gymnasium", {"env_id": "CliffWalking-v1", "actions": ["u", "U"]})
    assert "frozen_lake" in ENVIRONMENTS and "gymnasium" in ENVIRONMENTS


def test_any_discrete_gymnasium_env_through_the_generic_adapter() -> None:
    env = make_env("gymnasium", {"env_id": "CliffWalking-v1", "actions": ["up", "right", "down", "left"]})
    start, _ = env.reset(0)
    assert "x" in start  # CliffWalking's own text rendering: x is the player
    observation, reward, terminated, _, info = env.step("RIGHT")  # from the start, right is the cliff
    assert reward == -100.0 and info["action_is_valid"]
    assert env.step("jump")[4]["action_is_valid"] is False
    with pytest.raises(ValueError, match="has 4 actions, but 2 names were given"):
        make_env("gymnasium", {"env_id": "CliffWalking-v1", "actions": ["up", "down"]})
    with pytest.raises(ValueError, match="CartPole-v1 does not render as text"):
        make_env("gymnasium", {"env_id": "CartPole-v1", "actions": ["left", "right"]})
    continuous = GymnasiumTextEnv(
        make=lambda seed: gymnasium.make("MountainCarContinuous-v0"),
        render=lambda env, observation: str(observation),
        parse_action=lambda text: 0,
        action_help="",
    )
    with pytest.raises(TypeError, match="discrete actions"):
        continuous.reset(0)


def test_the_docs_example_environment_is_one_class_and_one_entry(repo_root, monkeypatch) -> None:
    import re

    import roll.envs.base
    from roll.utils.registry import Registry

    registry = Registry("environment")
    monkeypatch.setattr(roll.envs.base, "ENVIRONMENTS", registry)  # the example registers into a fresh one
    text = (repo_root / "docs" / "agentic.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "register(" in b]
    exec(compile(example, "docs/agentic.md", "exec"), {})
    env = registry.get("guess_number")(high=10)

    class Bisect:
        low, high = 1, 10

        def act(self, observation: str) -> str:
            if observation.startswith("Higher"):
                self.low = self.guess + 1
            elif observation.startswith("Lower"):
                self.high = self.guess - 1
            self.guess = (self.low + self.high) // 2
            return str(self.guess)

    episode = play(env, Bisect(), seed=4, max_turns=4)
    assert episode.success and episode.stop_reason == "env_done"
    assert env.step("many")[4]["action_is_valid"] is False
