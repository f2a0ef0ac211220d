"""The tools of the ``tool_use`` environment: a bounded calculator and Python in ``roll.sandbox``.

A tool takes the text of a call and returns the text the policy reads next. It raises ``MalformedCall``
when the text is not a call it can read (the policy's format error, an invalid action) and
``ToolFailure`` when it was called properly but returned no result (it raised, timed out, or the
sandbox failed): the two are counted apart, so a run whose tools break is not mistaken for a policy
that writes bad calls.

The calculator reads the expression with ``ast`` (never ``eval``) and computes exactly with
``Fraction``. Everything is bounded before or as it is computed, so no expression can make it slow:
the expression's length and nesting, and the size of every intermediate value (an exponent is refused
before it is computed if its result would be too large: ``9**9**9`` fails at once).
"""

from __future__ import annotations

import ast
import decimal
import math
import re
import signal
from fractions import Fraction

from roll.sandbox import SandboxLimits, SandboxUnavailable, run_python

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 16
# Numerator and denominator of every value stay below this many bits (about 150 decimal digits).
MAX_BITS = 512
# Non-integral results are shown with this many significant digits.
SIGNIFICANT_DIGITS = 12
# Digits, the operators + - * / // % ** and parentheses, a decimal point, spaces. Checked before
# ``ast``, so names, calls, attributes and Python-only spellings of numbers (0x11, 1e9, 1_000) never
# reach the parser.
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/%().\s]*")
# The python tool keeps at most this much of stdout and stderr (the sandbox kills a program past it).
PYTHON_OUTPUT_BYTES = 64 * 1024


class MalformedCall(ValueError):
    """The call's text is not one the tool can read: the policy's format error."""


class ToolFailure(RuntimeError):
    """A well-formed call that returned no result; ``timed_out`` when it ran out of time."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def calculate(expression: str) -> str:
    """The exact value of an arithmetic ``expression``: an integer as digits, anything else as a decimal
    of ``SIGNIFICANT_DIGITS`` significant digits.

    Accepted: integer and decimal literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses.

    Raises:
        MalformedCall: empty, longer than ``MAX_EXPRESSION_CHARS``, nested deeper than ``MAX_DEPTH``,
            other characters, or not an arithmetic expression.
        ToolFailure: a division by zero, a non-integral exponent, or a value past ``MAX_BITS``.
    """
    text = expression.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(text):
        raise MalformedCall(
            f"use digits, + - * / // % ** ( ) and . (at most {MAX_EXPRESSION_CHARS} characters)"
        )
    depth = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        if depth > MAX_DEPTH:
            raise MalformedCall(f"parentheses nested deeper than {MAX_DEPTH}")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise MalformedCall(f"not an arithmetic expression: {e}") from e
    return _render(_evaluate(tree))


def _evaluate(node: ast.AST) -> Fraction:
    """The exact value of ``node``; the recursion is bounded by ``MAX_EXPRESSION_CHARS``."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # repr() of a float literal is its shortest decimal spelling: 0.1 is 1/10, not the binary float.
        return _bounded(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return _bounded(left + right)
        if isinstance(node.op, ast.Sub):
            return _bounded(left - right)
        if isinstance(node.op, ast.Mult):
            return _bounded(left * right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            if right == 0:
                raise ToolFailure("division by zero")
            if isinstance(node.op, ast.Div):
                return _bounded(left / right)
            return _bounded(Fraction(left // right) if isinstance(node.op, ast.FloorDiv) else left % right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
    raise MalformedCall(f"{type(node).__name__} is not arithmetic")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent``, refused before it is computed when the result would pass ``MAX_BITS``."""
    if exponent.denominator != 1:
        raise ToolFailure("the exponent must be an integer")
    if base == 0 and exponent < 0:
        raise ToolFailure("division by zero")
    if base in (0, 1, -1):
        return base ** int(exponent)
    # With b the larger bit length of numerator and denominator (b >= 2 here), the result needs more than
    # (b - 1) * |exponent| bits: past MAX_BITS it is refused uncomputed; below, it has at most twice
    # MAX_BITS, cheap to compute and then checked exactly.
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (bits - 1) * abs(exponent) > MAX_BITS:
        raise ToolFailure(f"the result is too large (more than {MAX_BITS} bits)")
    return _bounded(base ** int(exponent))


def _bounded(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ToolFailure(f"the result is too large (more than {MAX_BITS} bits)")
    return value


def _render(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    with decimal.localcontext() as context:
        context.prec = SIGNIFICANT_DIGITS
        return str((decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)).normalize())


def run_python_tool(code: str, *, timeout_s: float, isolation: str = "auto") -> str:
    """What ``code`` prints, run as a fresh program in ``roll.sandbox`` for at most ``timeout_s`` seconds.

    Raises:
        MalformedCall: ``code`` is empty.
        ToolFailure: the program raised or exited non-zero (the message is the last line of its stderr),
            ran past ``timeout_s`` wall-clock or its CPU time (``timed_out``), printed more than
            ``PYTHON_OUTPUT_BYTES``, or the sandbox failed or is unavailable here.
    """
    if not code.strip():
        raise MalformedCall("no code")
    # The CPU limit trails the wall-clock one: a single-threaded loop always meets the wall clock first,
    # so it is reported as the timeout it is; a program that burns CPU on many threads meets the CPU limit.
    limits = SandboxLimits(
        timeout_s=timeout_s, cpu_s=math.ceil(timeout_s) + 1, max_output_bytes=PYTHON_OUTPUT_BYTES
    )
    try:
        result = run_python(code, limits=limits, isolation=isolation)
    except SandboxUnavailable as e:
        raise ToolFailure(f"no sandbox here: {e}") from e
    if result.error is not None:
        raise ToolFailure(f"the sandbox failed: {result.error}")
    if result.timed_out or result.signal == signal.SIGXCPU:
        raise ToolFailure(f"timed out after {timeout_s:g} s", timed_out=True)
    if result.output_truncated:
        raise ToolFailure(f"printed more than {PYTHON_OUTPUT_BYTES} bytes")
    if result.exit_code != 0:
        last_line = next((line for line in reversed(result.stderr.splitlines()) if line.strip()), "")
        if last_line:
            raise ToolFailure(last_line.strip())
        if result.signal is not None:
            raise ToolFailure(f"killed by signal {result.signal}")
        raise ToolFailure(f"exit status {result.exit_code}")
    return result.stdout
