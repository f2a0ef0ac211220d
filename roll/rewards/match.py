"""Rewards that compare the response with the dataset row's reference ``answer``."""

from __future__ import annotations

import math
import re

from roll.rewards.base import REWARD_FUNCTIONS, needs_fields

# Optional sign, then digits with an optional fraction (or a bare fraction like ".5"), then an optional
# exponent. Thousands separators are not understood: "1,000" reads as 1.
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")

_NUMERIC_TOLERANCE = 1e-6


def _answer(sample: dict, reward_name: str) -> object:
    """The row's ``answer`` field, or a KeyError that says which reward needs it and what the row has."""
    if "answer" not in sample:
        raise KeyError(
            f"reward '{reward_name}' needs an 'answer' field in each dataset row; "
            f"this row has keys {sorted(map(str, sample))}"
        )
    return sample["answer"]


def first_number(text: str) -> float | None:
    """The first integer or decimal number in ``text`` (optional sign and exponent), or ``None``."""
    match = _NUMBER.search(text)
    return float(match.group()) if match else None


@REWARD_FUNCTIONS.register("exact_match", inline=True)
@needs_fields("answer")
def exact_match(prompt: str, response: str, sample: dict) -> float:
    """1.0 if the response equals ``str(sample["answer"])`` after stripping surrounding whitespace.

    Args:
        prompt: unused.
        response: generated text.
        sample: dataset row with an ``answer`` field.

    Returns:
        1.0 or 0.0.
    """
    answer = _answer(sample, "exact_match")
    return 1.0 if response.strip() == str(answer).strip() else 0.0


@REWARD_FUNCTIONS.register("numeric_match", inline=True)
@needs_fields("answer")
def numeric_match(prompt: str, response: str, sample: dict) -> float:
    """1.0 if the first number in the response equals ``float(sample["answer"])`` within 1e-6.

    Args:
        prompt: unused.
        response: generated text; only its first number is read.
        sample: dataset row with a numeric ``answer`` field (number or numeric string).

    Returns:
        1.0 or 0.0 (0.0 when the response contains no number).

    Raises:
        KeyError: the row has no ``answer``.
        ValueError: the ``answer`` is not a number.
    """
    raw = _answer(sample, "numeric_match")
    try:
        answer = float(str(raw).strip())
    except ValueError:
        raise ValueError(f"reward 'numeric_match' needs a numeric 'answer', got {raw!r}") from None
    value = first_number(response)
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, answer, rel_tol=0.0, abs_tol=_NUMERIC_TOLERANCE) else 0.0


@REWARD_FUNCTIONS.register("char_match", inline=True)
@needs_fields("answer")
def char_match(prompt: str, response: str, sample: dict) -> float:
    """Partial credit: the share of characters that match the answer position by position, over the
    longer of the two strings; 1.0 exactly when the stripped response equals the answer.

    A denser signal than ``exact_match`` for short answers (digits of a sum): a response with most
    digits right earns more than one with none, so fewer groups have all-equal rewards.

    Args:
        prompt: unused.
        response: generated text.
        sample: dataset row with an ``answer`` field.

    Returns:
        A score in [0, 1].
    """
    answer = str(_answer(sample, "char_match")).strip()
    response = response.strip()
    longest = max(len(answer), len(response))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, response)) / longest
