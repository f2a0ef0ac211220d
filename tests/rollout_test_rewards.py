"""Rewards for the rollout tests, imported by the reward workers (``tests/`` is on their path)."""

from __future__ import annotations

from roll.rewards import REWARD_FUNCTIONS


@REWARD_FUNCTIONS.register("test_even_rows_agree")
def even_rows_agree(prompt: str, response: str, sample: dict) -> float:
    """Rows with an even ``answer`` score 1 whatever the response (a group with no signal); the others
    score the parity of the response's first character, which differs between random samples."""
    if int(sample["answer"]) % 2 == 0:
        return 1.0
    return float(response[:1] in "02468+")
