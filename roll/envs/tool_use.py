"""Tool use: answer a multiplication that a tiny model cannot do in its head, but can with a tool.

The seed makes the question, two numbers of ``digits`` digits each, shown as the first observation:

    37*48

A turn is one letter and what follows it (surrounding whitespace ignored, the letter in either case):

    c37*48            call the calculator on the expression 37*48
    pprint(37*48)     call python: the code runs in roll.sandbox, what it prints comes back
    a1776             answer 1776 (an integer); the episode ends

The letters cost one character each, for a character-level policy. A successful call's output comes back
as the next observation after ``=`` (``=1776``); a call that failed comes back as ``Tool error: <why>``,
and the episode goes on. Rewards: a right answer 1.0, a wrong one 0.0, a tool call 0.0, a turn that is
not one of the above the usual format penalty (``invalid_action_reward``, -0.1). Invalid turns: no such
letter, a tool that is not enabled (``tools``), a call with nothing to run, an expression the calculator
cannot read, an answer that is not an integer, and a call past ``max_tool_calls``; the observation after
one says so above the question.

The calculator is exact and bounded (``roll.envs.tools.calculate``: +, -, *, /, //, %, **, parentheses;
no name, call or huge power gets through); python runs only in the sandbox, for at most
``tool_timeout_s`` seconds. Every step's ``info["metrics"]``: ``tool_calls`` (1 if the turn called a
tool), ``tool_failures`` (1 if that call returned no result: it raised, timed out or the sandbox failed),
``tool_timeouts`` (1 if it timed out) and ``success`` (1.0 on a right answer). A malformed call is an
invalid action, not a tool failure.
"""

from __future__ import annotations

import random
import re
import textwrap
from collections.abc import Sequence
from typing import Any

from roll.envs.base import ENVIRONMENTS, StepResult, TextEnv, invalid_action
from roll.envs.gym_adapter import DEFAULT_INVALID_ACTION_REWARD
from roll.envs.tools import MalformedCall, ToolFailure, calculate, run_python_tool
from roll.sandbox.runner import ISOLATIONS

# The letter that calls each tool; ``ANSWER`` answers.
TOOL_LETTERS = {"c": "calculator", "p": "python"}
TOOLS = tuple(TOOL_LETTERS.values())
ANSWER = "a"
RESULT_PREFIX = "="
ERROR_PREFIX = "Tool error: "
MAX_DIGITS = 6
# An answer longer than this is no integer a question of MAX_DIGITS could have.
MAX_ANSWER_CHARS = 32
_INTEGER = re.compile(r"[+-]?\d+")
QUESTION = re.compile(r"^(\d+)\*(\d+)$", re.MULTILINE)


def _check_options(
    digits: int = 2,
    tools: Sequence[str] = ("calculator",),
    max_tool_calls: int = 2,
    tool_timeout_s: float = 5.0,
    max_output_chars: int = 200,
    sandbox_isolation: str = "auto",
    **_: object,
) -> None:
    name = "environment 'tool_use'"
    if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"{name}: digits must be an integer from 1 to {MAX_DIGITS}, got {digits!r}")
    if isinstance(tools, str) or not tools or any(tool not in TOOLS for tool in tools):
        raise ValueError(f"{name}: tools must be a non-empty list of {', '.join(TOOLS)}, got {tools!r}")
    if not isinstance(max_tool_calls, int) or isinstance(max_tool_calls, bool) or max_tool_calls < 0:
        raise ValueError(f"{name}: max_tool_calls must be an integer >= 0, got {max_tool_calls!r}")
    if not isinstance(tool_timeout_s, (int, float)) or not tool_timeout_s > 0:
        raise ValueError(f"{name}: tool_timeout_s must be a positive number, got {tool_timeout_s!r}")
    if not isinstance(max_output_chars, int) or max_output_chars < 1:
        raise ValueError(f"{name}: max_output_chars must be a positive integer, got {max_output_chars!r}")
    if sandbox_isolation not in ISOLATIONS:
        raise ValueError(
            f"{name}: sandbox_isolation must be one of {', '.join(ISOLATIONS)}, got {sandbox_isolation!r}"
        )


def question_for(seed: int, digits: int) -> tuple[int, int]:
    """The two factors the question of ``seed`` multiplies, each of ``digits`` digits."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def parse_question(observation: str) -> tuple[int, int] | None:
    """The factors of the question in ``observation`` (its last ``a*b`` line), or None."""
    found = QUESTION.findall(observation)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


@ENVIRONMENTS.register("tool_use", check_options=_check_options)
class ToolUse(TextEnv):
    """Answer ``a*b`` with the help of tools (see the module's docstring for the call format).

    Args:
        digits: digits of each factor (2: from 10*10 to 99*99).
        tools: the tools the policy may call, of ``calculator`` and ``python``.
        max_tool_calls: calls per episode; a call past it is an invalid action.
        tool_timeout_s: wall-clock limit of one python call (keep it below ``env.step_timeout_s``); the
            calculator is bounded by construction.
        max_output_chars: a tool's output is cut to this many characters.
        sandbox_isolation: the python tool's isolation (``roll.sandbox``): auto, unshare, bwrap, or none
            (no namespaces: only for code you trust).
        invalid_action_reward: the reward of a turn that is not a call or an answer.
    """

    def __init__(
        self,
        digits: int = 2,
        tools: Sequence[str] = ("calculator",),
        max_tool_calls: int = 2,
        tool_timeout_s: float = 5.0,
        max_output_chars: int = 200,
        sandbox_isolation: str = "auto",
        invalid_action_reward: float = DEFAULT_INVALID_ACTION_REWARD,
    ):
        _check_options(digits, tools, max_tool_calls, tool_timeout_s, max_output_chars, sandbox_isolation)
        self.digits, self.tools, self.max_tool_calls = digits, tuple(tools), max_tool_calls
        self.tool_timeout_s, self.max_output_chars = float(tool_timeout_s), max_output_chars
        self.sandbox_isolation, self.invalid_action_reward = sandbox_isolation, invalid_action_reward
        letters = [letter for letter, tool in TOOL_LETTERS.items() if tool in self.tools]
        calls = " or ".join(f"{letter}<{'expression' if letter == 'c' else 'code'}>" for letter in letters)
        self.action_help = f"Call a tool with {calls}, or answer with {ANSWER}<integer>."
        self.question: tuple[int, int] | None = None
        self.calls = 0

    def layout(self, seed: int) -> str:
        # a*b and b*a are one task: a held-out question is not trained on with its factors swapped.
        return "{}*{}".format(*sorted(question_for(seed, self.digits)))

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.question = question_for(seed, self.digits)
        self.calls = 0
        return self._question_text(), {}

    def step(self, action_text: str) -> StepResult:
        if self.question is None:
            raise RuntimeError("step() before reset()")
        text = action_text.strip()
        letter, payload = text[:1].lower(), text[1:]
        if letter == ANSWER:
            return self._answer(payload.strip())
        tool = TOOL_LETTERS.get(letter)
        if tool not in self.tools:
            return self._invalid("")
        if self.calls >= self.max_tool_calls:
            return self._invalid(f"No tool calls left ({self.max_tool_calls} per episode).")
        try:
            output = self._call(tool, payload)
        except MalformedCall as e:
            return self._invalid(f"Malformed {tool} call: {e}.")
        except ToolFailure as e:
            self.calls += 1
            observation = f"{ERROR_PREFIX}{e}"[: self.max_output_chars]
            return observation, 0.0, False, False, _info(called=True, failed=True, timed_out=e.timed_out)
        self.calls += 1
        observation = f"{RESULT_PREFIX}{output.rstrip()}"[: self.max_output_chars]
        return observation, 0.0, False, False, _info(called=True)

    def _call(self, tool: str, payload: str) -> str:
        if tool == "calculator":
            return calculate(payload)
        # Dedented, so that code written on the lines after the letter may be indented as a block.
        code = textwrap.dedent(payload).strip()
        return run_python_tool(code, timeout_s=self.tool_timeout_s, isolation=self.sandbox_isolation)

    def _answer(self, payload: str) -> StepResult:
        if len(payload) > MAX_ANSWER_CHARS or not _INTEGER.fullmatch(payload):
            return self._invalid("The answer must be an integer.")
        a, b = self.question
        right = int(payload) == a * b
        observation = "Right." if right else "Wrong."
        return observation, 1.0 if right else 0.0, True, False, _info(success=right)

    def _invalid(self, why: str) -> StepResult:
        help_text = f"{why} {self.action_help}" if why else self.action_help
        observation, reward, terminated, truncated, info = invalid_action(
            help_text, self._question_text(), self.invalid_action_reward
        )
        info["metrics"] = _info()["metrics"]
        return observation, reward, terminated, truncated, info

    def _question_text(self) -> str:
        return "{}*{}".format(*self.question)


def _info(
    called: bool = False, failed: bool = False, timed_out: bool = False, success: bool = False
) -> dict[str, Any]:
    metrics = {
        "tool_calls": float(called),
        "tool_failures": float(failed),
        "tool_timeouts": float(timed_out),
        "success": float(success),
    }
    return {"action_is_valid": True, "metrics": metrics}
