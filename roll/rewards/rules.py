"""Rule rewards that check the response's layout: ``think_answer_format`` and ``regex_match``.

Both score 1.0 or 0.0, so they serve equally as a weighted reward and as a multiplier that zeroes a
badly laid-out response (the domain's ``reward_multipliers``).
"""

from __future__ import annotations

import re
from functools import lru_cache

from roll.rewards.base import REWARD_FUNCTIONS

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# Tags are counted before this runs (each exactly once), so the lazy groups cannot swallow a second
# block and the match is linear.
_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)

REGEX_MODES = ("search", "fullmatch")


@REWARD_FUNCTIONS.register("think_answer_format", inline=True)
def think_answer_format(prompt: str, response: str, sample: dict) -> float:
    """1.0 when the response is a ``<think>...</think>`` block followed by an ``<answer>...</answer>``
    block and nothing else.

    Whitespace is allowed before, between and after the blocks. The think block may be empty (models
    with thinking switched off emit ``<think></think>``); the answer must not be blank. Each tag must
    appear exactly once, so a second answer block or a tag inside a block fails.

    Args:
        prompt: unused.
        response: generated text.
        sample: unused.

    Returns:
        1.0 or 0.0.
    """
    if any(response.count(tag) != 1 for tag in _TAGS):
        return 0.0
    match = _THINK_ANSWER.fullmatch(response)
    return 1.0 if match is not None and match.group(2).strip() else 0.0


@lru_cache(maxsize=256)
def compile_rule_pattern(pattern: str, mode: str = "search") -> re.Pattern[str]:
    """Check ``regex_match``'s options and compile its pattern, once per (pattern, mode).

    Callable ahead of time (when a config is loaded) so a bad pattern fails before any worker starts.

    Raises:
        ValueError: an empty or invalid pattern, or a mode other than ``REGEX_MODES``.
    """
    if mode not in REGEX_MODES:
        raise ValueError(f"reward 'regex_match': mode must be one of {', '.join(REGEX_MODES)}, got {mode!r}")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            "reward 'regex_match' needs a non-empty string 'pattern' option, e.g. '(?s)<answer>.+</answer>', "
            f"got {pattern!r}"
        )
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"reward 'regex_match': invalid pattern {pattern!r}: {e}") from None


def _check_regex_options(pattern: str = "", mode: str = "search") -> None:
    compile_rule_pattern(pattern, mode)


@REWARD_FUNCTIONS.register("regex_match", check_options=_check_regex_options)
def regex_match(
    prompt: str, response: str, sample: dict, *, pattern: str = "", mode: str = "search"
) -> float:
    """1.0 when the regular expression ``pattern`` matches the response.

    There is no flags option: write them inline, e.g. ``(?s)`` for ``.`` to match newlines, ``(?i)``
    to ignore case, ``(?m)`` for ``^``/``$`` at every line.

    Args:
        prompt: unused.
        response: generated text.
        sample: unused.
        pattern: a Python regular expression (required).
        mode: ``"search"``, a match anywhere in the response, or ``"fullmatch"``, the whole response.

    Returns:
        1.0 or 0.0.

    Raises:
        ValueError: an empty or invalid ``pattern`` or an unknown ``mode``.
    """
    compiled = compile_rule_pattern(pattern, mode)
    found = compiled.search(response) if mode == "search" else compiled.fullmatch(response)
    return 1.0 if found is not None else 0.0
