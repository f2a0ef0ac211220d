"""The environment of ``benchmarks/agentic.py``: varied episode lengths and a long-tail step latency.

``long_tail`` (registered in ``roll.envs.base.ENVIRONMENTS``) stands in for an agentic environment
whose steps wait on something outside the policy (a tool, a web page, a simulator): each ``step``
sleeps for a time drawn from a Pareto distribution, so most steps are quick and a few are very slow.

- **Episode length per seed.** ``reset(seed)`` draws the episode's length, uniform from ``min_turns`` to
  ``max_turns`` (1..12): the env ends the episode (``terminated``) after that many steps, whatever the
  policy says. Every episode of a seed has the same length.
- **Long-tail latency per (seed, turn).** Step k of an episode of ``seed`` sleeps ``sleep_scale_s x
  U^(-1/sleep_shape)`` seconds (``U`` uniform in (0, 1], seeded by ``(seed, k)``), capped at
  ``max_sleep_s``: Pareto with minimum 20 ms and shape 1.2 by default (median 36 ms, mean 79 ms, p90
  134 ms; one step in 21 over 250 ms, one in 120 over 1 s, one in 260 at the 2 s cap). The episodes of
  one group (one seed) wait alike at the same turn, and every mode of the benchmark meets exactly the
  same latencies. The sleep holds no core, as waiting on a tool would not.
- **Observations that make the context grow.** Every observation is ``"k: "`` (the turn) and
  ``observation_chars`` (default 16) lowercase letters and digits drawn per (seed, turn): with the
  benchmark's character tokenizer and chat template a turn adds about 26 tokens to the episode (22 of
  observation and template, the turn's own few), so turn k's context is the whole episode so far.
- **Any turn text is a valid action.** The reward is the share of the turn's characters that are
  vowels (a score that differs within a group, so GRPO has something to train on with a random
  policy); ``info["metrics"]["success"]`` is 1 on the step that ends the episode.

The benchmark names this module in its config's ``imports:`` list (``benchmarks.agentic_env``), so the
driver and every Ray worker import it (workers find it from the driver's working directory, the
repository root).
"""

from __future__ import annotations

import random
import string
import time
from typing import Any

from roll.envs.base import ENVIRONMENTS, TextEnv

ENV_NAME = "long_tail"
OBSERVATION_ALPHABET = string.ascii_lowercase + string.digits
VOWELS = frozenset("aeiou")


def _check_options(
    min_turns: int = 1,
    max_turns: int = 12,
    sleep_scale_s: float = 0.02,
    sleep_shape: float = 1.2,
    max_sleep_s: float = 2.0,
    observation_chars: int = 16,
) -> None:
    if not 1 <= min_turns <= max_turns:
        raise ValueError(
            f"environment '{ENV_NAME}': need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}"
        )
    if sleep_scale_s < 0 or max_sleep_s < 0:
        raise ValueError(f"environment '{ENV_NAME}': sleep_scale_s and max_sleep_s must be >= 0")
    if sleep_shape <= 0:
        raise ValueError(f"environment '{ENV_NAME}': sleep_shape must be > 0, got {sleep_shape}")
    if observation_chars < 1:
        raise ValueError(f"environment '{ENV_NAME}': observation_chars must be >= 1, got {observation_chars}")


def episode_length(seed: int, min_turns: int = 1, max_turns: int = 12) -> int:
    """The number of steps after which the episode of ``seed`` ends."""
    return random.Random(f"{ENV_NAME}:length:{seed}").randint(min_turns, max_turns)


def step_sleep(seed: int, turn: int, scale_s: float = 0.02, shape: float = 1.2, cap_s: float = 2.0) -> float:
    """Seconds step ``turn`` (0-based) of the episode of ``seed`` waits: Pareto(``shape``) from
    ``scale_s``, capped at ``cap_s``."""
    u = 1.0 - random.Random(f"{ENV_NAME}:sleep:{seed}:{turn}").random()  # in (0, 1]
    return min(cap_s, scale_s * u ** (-1.0 / shape))


@ENVIRONMENTS.register(ENV_NAME, check_options=_check_options)
class LongTailEnv(TextEnv):
    """Episodes of a length drawn per seed, each step sleeping a Pareto-distributed time (see the module
    docstring). Options as in ``_check_options``."""

    def __init__(
        self,
        min_turns: int = 1,
        max_turns: int = 12,
        sleep_scale_s: float = 0.02,
        sleep_shape: float = 1.2,
        max_sleep_s: float = 2.0,
        observation_chars: int = 16,
    ):
        _check_options(min_turns, max_turns, sleep_scale_s, sleep_shape, max_sleep_s, observation_chars)
        self.min_turns, self.max_turns = min_turns, max_turns
        self.sleep_scale_s, self.sleep_shape, self.max_sleep_s = sleep_scale_s, sleep_shape, max_sleep_s
        self.observation_chars = observation_chars
        self.seed, self.turn, self.length = 0, 0, 0

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.seed, self.turn = seed, 0
        self.length = episode_length(seed, self.min_turns, self.max_turns)
        return self._observation(), {}

    def step(self, action_text: str):
        time.sleep(step_sleep(self.seed, self.turn, self.sleep_scale_s, self.sleep_shape, self.max_sleep_s))
        self.turn += 1
        text = action_text.strip()
        reward = sum(ch in VOWELS for ch in text) / len(text) if text else 0.0
        done = self.turn >= self.length
        info = {"action_is_valid": True, "metrics": {"success": float(done)}}
        return self._observation(), reward, done, False, info

    def _observation(self) -> str:
        rng = random.Random(f"{ENV_NAME}:observation:{self.seed}:{self.turn}")
        return f"{self.turn}: " + "".join(
            rng.choice(OBSERVATION_ALPHABET) for _ in range(self.observation_chars)
        )
