"""``code_tests``: run the response's program in the sandbox against the dataset row's tests.

The program is the last fenced block of the response tagged ``python`` (or ``py``, ``python3``) or not
tagged at all, else the whole response, preceded by the row's optional ``code_prefix`` (e.g.
``"f=lambda x:"`` for a row whose answer is an expression). The row's ``tests`` is a list of cases:

* function call: ``{"call": "f(2)", "expected": 7}``. All calls of a row run in one sandboxed process.
  A trusted harness forks: its child executes the program as module ``solution``, evaluates each call
  and sends the result back as JSON; the harness alone reads a random nonce per call (from stdin) and
  writes each result on stdout as a line prefixed with that call's nonce. The child never holds a
  nonce or the real stdout (its prints go to stderr), and the harness is non-dumpable, so its memory
  and descriptors are out of reach: the only way a program shapes a result is the value a call
  returns. The parent process compares those values with ``expected``: the expected values never
  enter the sandbox (a program cannot print them), and the comparison is between plain JSON values
  outside it (an object whose ``__eq__`` always says yes is not JSON and fails, or is sent as the
  plain number or string it wraps). A missing, duplicated or unparsable result line fails its call.
  Numbers compare with a small tolerance (relative 1e-6, absolute 1e-9), ``True`` is not ``1``, and a
  tuple result equals a list.
* stdin/stdout: ``{"stdin": "1 2\\n", "stdout": "3\\n"}``, one sandboxed run per case; it passes when
  the program exits with status 0 and its output equals ``stdout`` once trailing whitespace is removed
  from every line and trailing blank lines are dropped.

The score is the share of cases passed (``mode="fraction"``) or 1.0 only when all pass (``mode="all"``).
A program that does not compile, crashes or times out fails every case it did not finish. The
counters in ``info`` are ``passed_frac``, ``timeout`` (a run hit ``timeout_s``) and ``sandbox_error``
(the sandbox itself failed: such a run scores 0 but says nothing about the program, and is logged).
A malformed test entry is a dataset bug and raises ``ValueError``.

Cost: one sandboxed run for all function calls, plus one per stdin/stdout case; each run is a fresh
interpreter (tens of milliseconds, see ``benchmarks/sandbox.py``) and at most ``timeout_s``. A program
with a syntax error is detected on its first stdin/stdout run, and the other cases are not run.
"""

from __future__ import annotations

import json
import logging
import marshal
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from roll.rewards.base import REWARD_FUNCTIONS, RewardOutput, needs_fields
from roll.sandbox import SandboxLimits, SandboxResult, run_python
from roll.sandbox.runner import ISOLATIONS

logger = logging.getLogger(__name__)

MODES = ("fraction", "all")
_PYTHON_TAGS = ("python", "py", "python3", "")
# An opening fence with an optional language tag, the block, then a closing fence or the end of the
# response (a response cut off by the token limit has no closing fence).
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_REL_TOL = 1e-6
_ABS_TOL = 1e-9
_SOLUTION_FILE = "solution.py"
_MIN_MEMORY_MB = 64  # below this the interpreter itself cannot start
_COMPILE_ERRORS = ("SyntaxError", "IndentationError", "TabError")

# Runs in the sandbox as main.py. It forks before reading anything: the child runs the program and the
# calls and sends each result back on a pipe; the parent alone reads the nonces (from stdin) and writes
# the result lines on the real stdout. The child never holds the nonces or a descriptor of that stdout,
# and the parent is made non-dumpable so that the child cannot read its memory or reopen its
# descriptors through /proc. So the only way a program can shape a result is the value a call returns.
_HARNESS = """\
import ctypes, marshal, os, select, sys, types

PR_SET_DUMPABLE = 4
ESCAPES = {'"': '\\\\"', "\\\\": "\\\\\\\\", "\\n": "\\\\n", "\\r": "\\\\r", "\\t": "\\\\t"}


def to_json(value, depth=0):
    # A small JSON writer: the json module (through re) costs more to import than the rest of a run.
    # Exact types only, so an int or str subclass with tricks of its own is not a result.
    if depth > 64:
        raise ValueError("nested too deeply")
    kind = type(value)
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int:
        return str(value)
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("not finite")
        return repr(value)
    if kind is str:
        return '"' + "".join(
            ESCAPES.get(c) or (c if c >= " " else "\\\\u%04x" % ord(c)) for c in value
        ) + '"'
    if kind is list or kind is tuple:
        return "[" + ",".join(to_json(item, depth + 1) for item in value) + "]"
    if kind is dict and all(type(key) is str for key in value):
        return "{" + ",".join(
            to_json(key) + ":" + to_json(item, depth + 1) for key, item in value.items()
        ) + "}"
    raise TypeError(kind.__name__ + " is not a JSON value")


def child(calls_r, results_w):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    with os.fdopen(calls_r, "rb") as f:
        calls = marshal.loads(f.read())
    results = os.fdopen(results_w, "w", encoding="utf-8")

    def send(index, status, payload):
        results.write(str(index) + " " + status + " " + payload + "\\n")
        results.flush()

    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module
    try:
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, "solution.py", "exec"), module.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            import traceback

            traceback.print_exc()
            return
    except BaseException:
        import traceback

        traceback.print_exc()
        return
    for index, call in enumerate(calls):
        try:
            payload = to_json(eval(compile(call, "<test>", "eval"), module.__dict__))
        except BaseException as exc:
            send(index, "error", '"' + type(exc).__name__ + '"')
            continue
        send(index, "ok", payload)


def parent(pid, calls_w, results_r):
    jobs = marshal.loads(bytes.fromhex(sys.stdin.read()))
    with os.fdopen(calls_w, "wb") as f:
        f.write(marshal.dumps([call for _, call in jobs]))
    exited = os.pidfd_open(pid)
    sent = set()
    buffer = b""
    while True:
        ready, _, _ = select.select([results_r, exited], [], [])
        if results_r not in ready:
            break  # the child is gone and wrote nothing more; a process it left may hold the pipe
        chunk = os.read(results_r, 1 << 16)
        if not chunk:
            break
        *lines, buffer = (buffer + chunk).split(b"\\n")
        for line in lines:
            index, _, rest = line.decode("utf-8", "replace").partition(" ")
            if index.isdigit() and int(index) < len(jobs) and int(index) not in sent:
                sent.add(int(index))
                sys.stdout.write(jobs[int(index)][0] + " " + rest + "\\n")
                sys.stdout.flush()
    os.waitpid(pid, 0)


def main():
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    calls_r, calls_w = os.pipe()
    results_r, results_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(calls_w)
        os.close(results_r)
        try:
            child(calls_r, results_w)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    os.close(calls_r)
    os.close(results_w)
    parent(pid, calls_w, results_r)


main()
"""


@dataclass(frozen=True)
class CallCase:
    """A function-call test: evaluate ``call`` after the program, compare with ``expected``."""

    call: str
    expected: Any


@dataclass(frozen=True)
class IOCase:
    """A stdin/stdout test: run the program on ``stdin``, compare its output with ``stdout``."""

    stdin: str
    stdout: str


def extract_program(response: str) -> str:
    """The last fenced block tagged python (``python``, ``py``, ``python3``) or untagged, else the whole
    response."""
    blocks = [body for tag, body in _FENCE.findall(response) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else response


def parse_tests(raw: Any) -> list[CallCase | IOCase]:
    """The row's ``tests`` as cases; a JSON string holding the list is accepted too.

    Raises:
        ValueError: the tests are not a non-empty list of valid cases; the message names the case.
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"reward 'code_tests': 'tests' is a string but not JSON: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"reward 'code_tests': 'tests' must be a non-empty list of cases, got {raw!r:.200}")
    cases: list[CallCase | IOCase] = []
    for i, case in enumerate(raw):
        where = f"reward 'code_tests': test {i} ({case!r:.200})"
        if not isinstance(case, dict):
            raise ValueError(f"{where} must be a dict")
        keys = set(case)
        if keys == {"call", "expected"}:
            call = case["call"]
            if not isinstance(call, str) or not call.strip():
                raise ValueError(f"{where}: 'call' must be a non-empty string")
            try:
                compile(call, "<test>", "eval")
            except SyntaxError as e:
                raise ValueError(f"{where}: 'call' is not a Python expression: {e.msg}") from None
            try:
                expected = json.loads(json.dumps(case["expected"], allow_nan=True))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: 'expected' must be a JSON value: {e}") from None
            cases.append(CallCase(call, expected))
        elif keys == {"stdin", "stdout"}:
            if not isinstance(case["stdin"], str) or not isinstance(case["stdout"], str):
                raise ValueError(f"{where}: 'stdin' and 'stdout' must be strings")
            cases.append(IOCase(case["stdin"], case["stdout"]))
        else:
            raise ValueError(
                f"{where} must have exactly the keys 'call' and 'expected', or 'stdin' and 'stdout'; "
                f"it has {sorted(map(str, keys))}"
            )
    return cases


def values_match(got: Any, expected: Any) -> bool:
    """Whether JSON value ``got`` equals ``expected``: numbers within the tolerance (NaN equals NaN),
    booleans only booleans, lists element by element, dicts key by key, the rest exactly."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is bool and type(expected) is bool and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        try:
            g, e = float(got), float(expected)
        except OverflowError:
            return False
        if math.isnan(g) or math.isnan(e):
            return math.isnan(g) and math.isnan(e)
        return math.isclose(g, e, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(values_match(g, e) for g, e in zip(got, expected))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(values_match(got[k], expected[k]) for k in expected)
        )
    if expected is None:
        return got is None
    return type(got) is type(expected) and got == expected


def normalize_output(text: str) -> str:
    """Output as compared in stdin/stdout cases: trailing whitespace of each line and trailing blank
    lines removed."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


def _check_options(
    mode: str = "fraction", timeout_s: float = 5.0, memory_mb: int = 512, isolation: str = "auto"
) -> None:
    if mode not in MODES:
        raise ValueError(f"reward 'code_tests': mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"reward 'code_tests': timeout_s must be positive, got {timeout_s!r}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < _MIN_MEMORY_MB:
        raise ValueError(
            f"reward 'code_tests': memory_mb must be an integer >= {_MIN_MEMORY_MB}, got {memory_mb!r}"
        )
    if isolation not in ISOLATIONS:
        raise ValueError(
            f"reward 'code_tests': isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}"
        )


@REWARD_FUNCTIONS.register("code_tests", check_options=_check_options)
@needs_fields("tests")
def code_tests(
    prompt: str,
    response: str,
    sample: dict,
    *,
    mode: str = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    isolation: str = "auto",
) -> RewardOutput:
    """Score the response's program by the row's tests, run in the sandbox (see the module docstring).

    Args:
        prompt: unused.
        response: generated text holding the program.
        sample: dataset row with ``tests`` and optionally ``code_prefix``.
        mode: "fraction" (share of cases passed) or "all" (1.0 only when every case passes).
        timeout_s: wall-clock limit of each sandboxed run (all function calls share one run).
        memory_mb: address-space limit of the program, in MiB.
        isolation: sandbox isolation: "auto", "bwrap", "unshare" or "none" (see ``roll.sandbox``).

    Returns:
        ``RewardOutput`` with the score and ``info`` counters ``passed_frac``, ``timeout``,
        ``sandbox_error`` and ``left_processes`` (it left processes running, which were killed; it
        then scores 0).

    Raises:
        KeyError: the row has no ``tests``.
        ValueError: a malformed test case or option.
        SandboxUnavailable: the sandbox isolation asked for does not work on this machine.
    """
    _check_options(mode, timeout_s, memory_mb, isolation)
    if "tests" not in sample:
        raise KeyError(
            f"reward 'code_tests' needs a 'tests' field; this row has keys {sorted(map(str, sample))}"
        )
    cases = parse_tests(sample["tests"])
    prefix = sample.get("code_prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"reward 'code_tests': 'code_prefix' must be a string, got {prefix!r:.200}")
    program = prefix + extract_program(response)
    # The CPU limit sits a second past the wall-clock timeout: an endless loop is then always reported
    # as a timeout (reward/code/timeout), never as a crash from whichever limit fired first.
    limits = SandboxLimits(timeout_s=float(timeout_s), cpu_s=math.ceil(timeout_s) + 1, memory_mb=memory_mb)
    runs: list[SandboxResult] = []

    calls = [c for c in cases if isinstance(c, CallCase)]
    passed = _run_calls(program, calls, limits, isolation, runs) if calls else 0
    io_cases = [c for c in cases if isinstance(c, IOCase)]
    for done, case in enumerate(io_cases, start=len(calls)):
        if mode == "all" and passed < done:
            break  # a case already failed: the score is 0 whatever the rest do
        result = run_python(program, stdin=case.stdin, limits=limits, isolation=isolation)
        runs.append(result)
        if result.ok and not result.output_truncated:
            passed += normalize_output(result.stdout) == normalize_output(case.stdout)
        elif _compile_error(result):
            break  # the same program fails the same way on every input

    fraction = passed / len(cases)
    score = fraction if mode == "fraction" else float(passed == len(cases))
    # A program that leaves processes running (a daemon) misbehaves whatever its answers: they were
    # killed, and it earns nothing.
    left_behind = any(r.leftover_processes for r in runs)
    if left_behind:
        score = 0.0
    errors = [r.error for r in runs if r.error is not None]
    if errors:
        logger.warning("code_tests: the sandbox failed (the response scores 0 for it): %s", errors[0])
    info = {
        "passed_frac": fraction,
        "timeout": float(any(r.timed_out for r in runs)),
        "sandbox_error": float(bool(errors)),
        "left_processes": float(left_behind),
    }
    return RewardOutput(score, info=info)


def _run_calls(
    program: str, calls: list[CallCase], limits: SandboxLimits, isolation: str, runs: list[SandboxResult]
) -> int:
    """Run every call in one sandboxed process; the number whose result matches ``expected``."""
    nonces = [secrets.token_hex(16) for _ in calls]
    jobs = marshal.dumps([(nonce, case.call) for nonce, case in zip(nonces, calls)]).hex()
    result = run_python(
        _HARNESS, stdin=jobs, limits=limits, isolation=isolation, files={_SOLUTION_FILE: program}
    )
    runs.append(result)
    lines: dict[str, list[tuple[str, str]]] = {nonce: [] for nonce in nonces}
    for line in result.stdout.splitlines():
        nonce, _, rest = line.partition(" ")
        if nonce in lines:
            status, _, payload = rest.partition(" ")
            lines[nonce].append((status, payload))
    passed = 0
    for nonce, case in zip(nonces, calls):
        reported = lines[nonce]
        if len(reported) != 1 or reported[0][0] != "ok":
            continue
        try:
            value = json.loads(reported[0][1])
        except (ValueError, RecursionError):
            continue
        passed += values_match(value, case.expected)
    return passed


def _compile_error(result: SandboxResult) -> bool:
    """The run failed because the program does not compile (Python prints no traceback header then)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return (
        result.exit_code == 1
        and bool(lines)
        and lines[-1].startswith(_COMPILE_ERRORS)
        and not result.stderr.startswith("Traceback")
    )
