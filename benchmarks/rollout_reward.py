"""The reward of ``benchmarks/rollout.py``: a stand-in for a sandboxed code-execution reward.

``slow_digits`` sleeps ``REWARD_SECONDS`` (20 ms) per response, as a reward that runs the response in a
sandbox spends waiting on it, then scores the share of the response's characters that are digits (1.0
when it equals the row's ``answer``): a score that varies within a group, so GRPO has advantages to
train on even with a random policy. The sleep holds no core, as waiting on a sandbox would not.

The benchmark names this module in its config's ``imports:`` list (``benchmarks.rollout_reward``), so
the driver and every Ray worker import it (workers find it from the driver's working directory, the
repository root).
"""

from __future__ import annotations

import time

from roll.rewards.base import REWARD_FUNCTIONS, needs_fields

REWARD_NAME = "slow_digits"
REWARD_SECONDS = 0.020


@REWARD_FUNCTIONS.register(REWARD_NAME)
@needs_fields("answer")
def slow_digits(prompt: str, response: str, sample: dict) -> float:
    time.sleep(REWARD_SECONDS)
    text = response.strip()
    if text == str(sample["answer"]).strip():
        return 1.0
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
