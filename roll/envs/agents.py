"""Agents that play a ``TextEnv`` without a model: a random one, a scripted FrozenLake expert (optionally
noisy, the warm start's teacher), and ``play``, which runs one episode. They test an env alone and
measure the baselines an RL run must beat."""

from __future__ import annotations

import collections
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from roll.envs.base import Observation, TextEnv, observed_state
from roll.envs.frozen_lake import ACTIONS, shortest_path
from roll.utils.registry import Registry, accepted_kwargs

# Agents by name: the SFT warm start of an agentic run imitates one (``sft_warm_start.expert``).
AGENTS: Registry[type] = Registry("agent")


class Agent(Protocol):
    def act(self, observation: str) -> str: ...


@AGENTS.register("random")
class RandomAgent:
    """Picks one of ``actions`` uniformly at random (seeded)."""

    def __init__(self, actions: Sequence[str] = ACTIONS, seed: int = 0):
        self.actions, self.rng = list(actions), random.Random(seed)

    def act(self, observation: str) -> str:
        return self.rng.choice(self.actions)


@AGENTS.register("constant")
class ConstantAgent:
    """Always the same action: the baseline a policy that collapsed onto one action would score."""

    def __init__(self, action: str):
        self.action = action

    def act(self, observation: str) -> str:
        return self.action


@AGENTS.register("frozen_lake_expert")
class FrozenLakeExpert:
    """The first step of a shortest path to the goal, read from the grid; with probability ``noise`` a
    random letter instead (a noisy expert to imitate, which RL should then beat)."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.noise, self.rng = noise, random.Random(seed)

    def act(self, observation: Observation) -> str:
        path = shortest_path(observed_state(observation))
        if self.rng.random() < self.noise or not path:
            return self.rng.choice(ACTIONS)
        return path[0]


@AGENTS.register("sokoban_expert")
class SokobanExpert:
    """The first move of a shortest solution (breadth-first search on the room the observation shows);
    with probability ``noise`` a random letter instead."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.noise, self.rng = noise, random.Random(seed)

    def act(self, observation: str) -> str:
        from roll.envs.sokoban import ACTIONS as SOKOBAN_ACTIONS
        from roll.envs.sokoban import Room, solve

        path = solve(Room.parse(observation))
        if self.rng.random() < self.noise or not path:
            return self.rng.choice(SOKOBAN_ACTIONS)
        return path[0]


def make_agent(name: str, options: dict | None = None, seed: int = 0) -> Agent:
    """The registered agent ``name`` with ``options`` (and ``seed``, when it takes one)."""
    cls = AGENTS.get(name)
    return cls(**(options or {}), **accepted_kwargs(cls, {"seed": seed}))


@dataclass
class Episode:
    """One played episode: what the agent saw and did, and how it ended."""

    seed: int
    observations: list[str] = field(default_factory=list)  # the first one, then one per turn
    actions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    stop_reason: str = ""  # "env_done" (terminated or truncated) or "max_turns"

    @property
    def episode_return(self) -> float:
        return sum(self.rewards)

    @property
    def success(self) -> bool:
        return any(m.get("success", 0.0) > 0 for m in self.metrics)


def play(env: TextEnv, agent: Agent, seed: int, max_turns: int) -> Episode:
    """Run one episode of ``env`` from ``seed`` with ``agent`` for at most ``max_turns`` turns."""
    observation, _ = env.reset(seed)
    episode = Episode(seed, [observation])
    for _ in range(max_turns):
        action = agent.act(observation)
        observation, reward, terminated, truncated, info = env.step(action)
        episode.observations.append(observation)
        episode.actions.append(action)
        episode.rewards.append(reward)
        episode.valid.append(bool(info["action_is_valid"]))
        episode.metrics.append(dict(info.get("metrics", {})))
        if terminated or truncated:
            episode.stop_reason = "env_done"
            return episode
    episode.stop_reason = "max_turns"
    return episode


@AGENTS.register("tool_expert")
class ToolExpert:
    """Plays ``tool_use``: calls the calculator on the question, then answers with the tool's result. With
    probability ``noise`` per episode it answers the question at once instead, with a plausible guess
    that is usually wrong (the product of the factors rounded to their leading digit: 37*48 -> 2000), so
    that a policy imitating it calls the tool less often than it should and RL has room to improve."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.noise, self.rng = noise, random.Random(seed)

    def act(self, observation: str) -> str:
        from roll.envs.tool_use import ANSWER, RESULT_PREFIX, parse_question

        if observation.startswith(RESULT_PREFIX):  # the calculator's answer: copy it
            return ANSWER + observation[len(RESULT_PREFIX) :].strip()
        question = parse_question(observation)
        if question is None:  # a tool error (never seen with the calculator on a question): give up
            return ANSWER + "0"
        a, b = question
        if self.rng.random() < self.noise:
            return ANSWER + str(_leading_digit(a) * _leading_digit(b))
        return f"c{a}*{b}"


@AGENTS.register("tool_call_expert")
class ToolCallExpert:
    """The teacher of an agent program that multiplies with a calculator tool through the API's tool calls
    (``examples/agent_calculator.yaml``). It reads the whole prompt, as its chat template rendered it: after
    a ``<tool_response>`` it answers with the result; on a question ``37*48`` it calls ``tool`` as
    ``<tool_call>{"name": tool, "arguments": {argument: "37*48"}}</tool_call>`` (compact JSON, as the tiny
    template writes calls). With probability ``noise`` it guesses instead, as ``tool_expert`` does."""

    def __init__(self, noise: float = 0.0, tool: str = "calc", argument: str = "x", seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.noise, self.tool, self.argument, self.seed = noise, tool, argument, seed
        self._played: collections.Counter[str] = collections.Counter()

    def act(self, observation: str) -> str:
        results = re.findall(r"<tool_response>(.*?)</tool_response>", observation, re.DOTALL)
        if results:
            return results[-1].strip()
        questions = re.findall(r"(\d+)\*(\d+)", observation)
        if not questions:
            return "0"
        a, b = (int(n) for n in questions[-1])
        # Seeded by the question and how often it was asked: the runs' calls arrive in whatever order
        # their agents make them, and the demonstrations must not depend on it.
        self._played[f"{a}*{b}"] += 1
        rng = random.Random(f"{self.seed}:{a}*{b}:{self._played[f'{a}*{b}']}")
        if rng.random() < self.noise:
            return str(_leading_digit(a) * _leading_digit(b))
        call = {"name": self.tool, "arguments": {self.argument: f"{a}*{b}"}}
        return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def _leading_digit(n: int) -> int:
    """``n`` rounded to its leading digit (37 -> 40, 150 -> 200, 7 -> 7)."""
    scale = 10 ** (len(str(n)) - 1)
    return round(n / scale) * scale
