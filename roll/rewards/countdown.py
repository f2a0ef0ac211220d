"""``countdown``: does the response's equation reach the target from the given numbers?

The equation is read with ``ast`` (never ``eval``) and evaluated exactly with ``Fraction``. Only
integer literals, the binary operators ``+ - * /`` and parentheses are accepted; a minus sign directly
in front of a literal makes it a negative number (``-3`` is the number -3, which must be given), and
every other unary operator is rejected. Inputs are bounded before parsing (``MAX_EQUATION_CHARS``
characters, ``MAX_DEPTH`` levels of parentheses), so no response can make the check slow.
"""

from __future__ import annotations

import ast
import numbers
import re
from collections import Counter
from fractions import Fraction

from roll.rewards.base import REWARD_FUNCTIONS, RewardOutput, needs_fields

MAX_EQUATION_CHARS = 200
# Real answers nest a handful of levels; the bound keeps ``ast`` and the evaluator far from any limit.
MAX_DEPTH = 16

# "(1 + 2) * 3 = 9": the claimed value is not checked; the left side is what gets evaluated.
_TRAILING_VALUE = re.compile(r"=\s*[-+]?\d+(?:\.\d+)?\s*$")
# Decimal digits, operators, parentheses and spaces. Checked before ``ast`` so that Python-only
# spellings of integers (``0x11``, ``1_7``) and names never reach the parser.
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]*")

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class _Malformed(Exception):
    """The equation is not an arithmetic expression over integer literals."""


def extract_equation(response: str) -> str:
    """The content of the last ``<answer>...</answer>`` (else the whole response), stripped, without a
    trailing ``= <value>``."""
    # The last block counts (models restate earlier attempts), found with rfind rather than a regex:
    # a lazy ``<answer>(.*?)</answer>`` rescans the text for every unclosed tag, quadratic on spam.
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    text = (response[start + len("<answer>") : end] if start >= 0 else response).strip()
    if len(text) > 2 * MAX_EQUATION_CHARS:
        return text  # rejected as too long anyway; not worth a regex pass
    return _TRAILING_VALUE.sub("", text).strip()


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction | None:
    """Exact value of ``node`` (None after a division by zero), appending each integer literal it uses
    to ``literals``. Evaluation goes on past a zero division so that every literal is still counted.
    The recursion is bounded by the equation's length: every level takes at least two characters.

    Raises:
        _Malformed: a construct other than integer literals, ``+ - * /`` and a literal's own minus.
    """
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    ):
        literals.append(-node.operand.value)
        return Fraction(-node.operand.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, literals)
        right = _evaluate(node.right, literals)
        if left is None or right is None or (isinstance(node.op, ast.Div) and right == 0):
            return None
        return _OPERATORS[type(node.op)](left, right)
    raise _Malformed(f"{type(node).__name__} is not allowed")


def _parse(equation: str) -> ast.expr:
    if not equation or len(equation) > MAX_EQUATION_CHARS or not _ALLOWED_CHARS.fullmatch(equation):
        raise _Malformed("empty, too long, or has characters other than digits, + - * / ( )")
    depth = 0
    for char in equation:
        depth += (char == "(") - (char == ")")
        if depth > MAX_DEPTH:
            raise _Malformed("parentheses nested too deeply")
    try:
        return ast.parse(equation, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _Malformed(str(e)) from e


def _as_int(value: object, what: str) -> int:
    """``value`` as an int: integers (NumPy's too), integral floats and integer strings are accepted."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"reward 'countdown' needs integer {what}, got {value!r}")


@REWARD_FUNCTIONS.register("countdown")
@needs_fields("numbers", "target")
def countdown(
    prompt: str, response: str, sample: dict, *, use_all: bool = True, format_score: float = 0.0
) -> RewardOutput:
    """1.0 when the response's equation uses the given numbers and evaluates exactly to the target.

    Args:
        prompt: unused.
        response: generated text; the equation is the content of its last ``<answer>...</answer>``
            (the whole response when there is none), a trailing ``= <value>`` ignored.
        sample: dataset row with ``numbers`` (a list of integers) and ``target`` (an integer).
        use_all: every given number must be used exactly once; when False, each at most as often as
            it is given.
        format_score: the score of a well-formed equation that misses (wrong numbers, wrong value, or
            a division by zero).

    Returns:
        A ``RewardOutput``: 1.0, ``format_score`` or 0.0 (malformed), with ``info`` counters
        ``malformed``, ``bad_numbers`` and ``wrong_value`` (each 0 or 1, at most one of them 1).

    Raises:
        KeyError: the row lacks ``numbers`` or ``target``.
        ValueError: ``numbers`` is not a list of integers or ``target`` is not an integer.
    """
    for key in ("numbers", "target"):
        if key not in sample:
            raise KeyError(
                f"reward 'countdown' needs a '{key}' field in each dataset row; "
                f"this row has keys {sorted(map(str, sample))}"
            )
    if isinstance(sample["numbers"], (str, bytes)) or not hasattr(sample["numbers"], "__iter__"):
        raise ValueError(f"reward 'countdown' needs 'numbers' to be a list, got {sample['numbers']!r}")
    given = Counter(_as_int(n, "numbers") for n in sample["numbers"])
    target = _as_int(sample["target"], "target")

    def result(score: float, outcome: str | None) -> RewardOutput:
        counters = {key: float(key == outcome) for key in ("malformed", "bad_numbers", "wrong_value")}
        return RewardOutput(score, info=counters)

    literals: list[int] = []
    try:
        value = _evaluate(_parse(extract_equation(response)), literals)
    except _Malformed:
        return result(0.0, "malformed")
    used = Counter(literals)
    if use_all:
        numbers_ok = used == given
    else:
        numbers_ok = all(count <= given[n] for n, count in used.items())
    if not numbers_ok:
        return result(format_score, "bad_numbers")
    if value is None or value != target:
        return result(format_score, "wrong_value")
    return result(1.0, None)
