"""``math_verify``: is the response's final answer mathematically equal to the row's reference answer?

Answers are extracted and compared with the ``math-verify`` package (``\\frac{1}{2}``, ``0.5`` and
``\\boxed{\\dfrac{2}{4}}`` are all equal; units such as ``5\\text{ cm}`` are dropped). It is an optional
dependency, imported on first use: ``pip install 'math-verify[antlr4_13_2]'``.

Sympy can spend unbounded time on a hostile answer (``\\boxed{10^{10^{10}}}`` or ``\\boxed{(10^8)!}``
keep it busy until something stops it), so every call runs under a deadline. math-verify's own deadline is
``signal.alarm``, which exists only in the main thread, takes whole seconds, applies to each parse and
each comparison separately (a response with many candidates can run for many times the limit), and
reports an expiry only as a log line. This module therefore switches math-verify's timeouts off and
brings its own, one deadline for the whole call:

* On the main thread (a plain Ray actor method, a driver), the work runs in-process under
  ``signal.setitimer``, whose handler raises an exception that math-verify's ``except Exception``
  handlers do not swallow; the timer fires again every ``_REFIRE_S`` until the work stops, in case
  some library catches it anyway. Overhead: arming and disarming a timer, small against a typical
  parse and comparison.
* On any other thread (a threaded actor, the rollout scheduler) signals cannot be used, and a thread
  cannot be stopped from outside, so the work is sent to a helper process (one per process that uses
  it, started on first use, calls serialised by a lock). The helper applies the same in-process
  deadline on its own main thread, so an ordinary timeout costs nothing more; a helper still busy
  ``_KILL_GRACE_S`` after the deadline (stuck in C code that never checks for signals) is killed and a
  new one started at once. Overhead: one pickled round trip per call, plus the start of a helper
  process the first time and after each kill (the replacement starts in the background), and the
  helper's memory.

A timeout scores 0 and is counted as ``info["timeout"]``; a response with nothing to extract scores 0
and is counted as ``info["no_answer"]``.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from decimal import Decimal
from functools import lru_cache
from multiprocessing.connection import Connection
from typing import Any

from roll.rewards.base import REWARD_FUNCTIONS, RewardOutput, needs_fields

logger = logging.getLogger(__name__)

# After the deadline has fired once, fire again this often until the work stops: code that catches
# the first exception (broad ``except BaseException`` blocks) is interrupted by the next one.
_REFIRE_S = 0.05
# How long past the deadline the helper may stay silent before it is killed: room for pickling and
# for a signal that waits on a short C call, while a truly stuck helper is still ended promptly.
_KILL_GRACE_S = 1.0
# Starting a helper imports sympy and math-verify (under a second, more on a loaded machine); a
# helper that has not started after this long never will.
_HELPER_START_TIMEOUT_S = 120.0

_INSTALL_HINT = "pip install 'math-verify[antlr4_13_2]'"


class _Deadline(BaseException):
    """Raised by the deadline's signal handler. A BaseException, so that the ``except Exception``
    handlers in math-verify and sympy let it through instead of reporting a failed parse."""


@lru_cache(maxsize=1)
def _extraction_config() -> tuple[Any, ...]:
    """LaTeX extraction with ``\\boxed{}`` matched first, then plain expressions (``3/4``, ``-0.75``).

    One shared instance for gold and response alike: math-verify caches the compiled regexes of only
    the last config it saw, so alternating two configs would recompile them on every call.
    """
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig
    except ImportError as e:
        raise ImportError(f"reward 'math_verify' needs the math-verify package: {_INSTALL_HINT}") from e
    # Our own deadline replaces math-verify's, so its once-per-process warning that no timeout is set
    # would only mislead whoever reads the logs.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is"))
    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def gold_latex(answer: object) -> str:
    """The reference answer as text math-verify can parse: bare LaTeX (``\\frac{3}{4}``) and numbers
    are wrapped in ``$...$``; text that already has math delimiters or a ``\\boxed{}`` is kept.

    Raises:
        ValueError: the answer is empty, NaN or infinite.
    """
    if isinstance(answer, float):
        if answer != answer or answer in (float("inf"), float("-inf")):
            raise ValueError(f"reward 'math_verify' needs a finite 'answer', got {answer!r}")
        # repr(1e-07) is '1e-07', which LaTeX reads as 1*e - 7; positional notation keeps the value.
        text = format(Decimal(repr(answer)), "f")
    else:
        text = str(answer).strip()
    if not text:
        raise ValueError("reward 'math_verify' needs a non-empty 'answer'")
    if any(marker in text for marker in ("$", "\\(", "\\[", "\\boxed")):
        return text
    return f"${text}$"


def grade(gold: str, response: str) -> tuple[bool, bool]:
    """Parse both sides and compare them, with no deadline of its own (callers add one).

    Args:
        gold: the reference answer, as ``gold_latex`` returns it.
        response: the generated text.

    Returns:
        ``(found, correct)``: whether an answer could be extracted from the response, and whether it
        equals the gold answer.
    """
    from math_verify import parse, verify

    config = _extraction_config()
    gold_parsed = parse(gold, extraction_config=config, parsing_timeout=None)
    if not gold_parsed:
        # Wrapping can hide an answer that parses as a plain expression only; the raw text is the
        # last resort before comparing nothing.
        gold_parsed = parse(gold.strip("$"), extraction_config=config, parsing_timeout=None)
    answer = parse(response, extraction_config=config, parsing_timeout=None)
    if not answer:
        return False, False
    return True, bool(verify(gold_parsed, answer, timeout_seconds=None))


def call_with_deadline(fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[Any, bool]:
    """Run ``fn(*args)`` in this process, interrupted after ``timeout_s`` seconds. Main thread only.

    A SIGALRM handler or timer already set by the caller is put back afterwards, the timer with what
    was left of it, so an enclosing deadline still fires.

    Returns:
        ``(value, timed_out)``; ``value`` is None when it timed out.
    """
    state = {"done": False, "fired": False}

    def on_alarm(signum: int, frame: object) -> None:
        if state["done"]:
            return
        state["fired"] = True
        signal.setitimer(signal.ITIMER_REAL, _REFIRE_S)
        raise _Deadline()

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)

    def disarm() -> None:
        # ``done`` first: from then on a late firing is a no-op, so the rest cannot be interrupted.
        state["done"] = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        # None means a handler installed outside Python, which cannot be put back; default is closest.
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        if previous_delay > 0:
            left = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), previous_interval)

    value = None
    try:
        try:
            value = fn(*args)
        finally:
            # A firing can land inside disarm() before ``done`` is set; run it again until it completes.
            while True:
                try:
                    disarm()
                    break
                except _Deadline:
                    continue
    except _Deadline:
        pass
    # ``fired`` also catches work that swallowed the exception and then returned normally.
    return (None, True) if state["fired"] else (value, False)


class _Helper:
    """A child Python process that runs calls under a deadline and is killed when it overstays it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[Any, bool]:
        """``call_with_deadline(fn, args, timeout_s)`` in the helper. ``fn`` travels by reference, so it
        must be a module-level function the helper can import.

        Raises:
            RuntimeError: the helper could not start, or ``fn`` raised (the helper's traceback is
                included).
        """
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._conn is not None
            self._wait_ready()
            try:
                self._conn.send((fn, args, timeout_s))
                answered = self._conn.poll(timeout_s + _KILL_GRACE_S)
                reply = self._conn.recv() if answered else None
            except (EOFError, OSError):
                logger.warning("math_verify: the helper process died during a call; starting a new one")
                self._restart()
                return None, True
            if reply is None:
                logger.warning(
                    "math_verify: the helper process was still busy %.1f s after the %.1f s deadline; "
                    "killed it and started a new one",
                    _KILL_GRACE_S,
                    timeout_s,
                )
                self._restart()
                return None, True
        status, payload = reply
        if status == "error":
            raise RuntimeError(f"math_verify: the grading call failed in the helper process:\n{payload}")
        return payload

    def _start(self) -> None:
        self.close()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The helper must import what this process can (the reward's module, a test's function).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        boot = "import sys; from roll.rewards.math import _serve; _serve(int(sys.argv[1]))"
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", boot, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self._conn = Connection(ours.detach())
        self._ready = False

    def _wait_ready(self) -> None:
        """Wait for the helper's start-up; a helper that cannot start is an error, not a timeout, so
        that a broken environment fails loudly instead of scoring every answer 0."""
        if self._ready:
            return
        assert self._conn is not None
        try:
            started = self._conn.poll(_HELPER_START_TIMEOUT_S)
            status, payload = self._conn.recv() if started else ("silent", None)
        except (EOFError, OSError):
            status, payload = "exited", "(it exited; its error, if any, is on this process's stderr)"
        if status != "ready":
            self.close()
            if status == "silent":
                payload = f"(no sign of life in {_HELPER_START_TIMEOUT_S:.0f} s)"
            raise RuntimeError(f"math_verify: the helper process failed to start:\n{payload}")
        self._ready = True

    def _restart(self) -> None:
        # Start the replacement now, so its imports overlap whatever the caller does next.
        self.close()
        self._start()

    def close(self) -> None:
        """Kill the helper (if any) and reap it."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        self._ready = False


_helpers: dict[int, _Helper] = {}
_helpers_lock = threading.Lock()


def _helper() -> _Helper:
    # Keyed by pid: a forked child must not share its parent's helper (their replies would mix).
    pid = os.getpid()
    with _helpers_lock:
        if pid not in _helpers:
            _helpers[pid] = _Helper()
            atexit.register(_helpers[pid].close)
        return _helpers[pid]


def _serve(fd: int) -> None:
    """The helper process's loop: answer ``(fn, args, timeout_s)`` requests until the parent goes."""
    # Ctrl-C reaches the whole process group; stopping is the parent's decision, signalled by closing
    # the connection.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        # Warm math-verify's caches (regexes, grammar) here, not under the first call's deadline.
        grade("$1$", "\\boxed{1}")
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            # Unpickled here, not by recv(), so that a function this process cannot import is reported
            # to the caller instead of ending the helper.
            fn, args, timeout_s = pickle.loads(request)
            reply = ("ok", call_with_deadline(fn, args, timeout_s))
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            return


def run_with_deadline(fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[Any, bool]:
    """``fn(*args)`` stopped after ``timeout_s`` seconds, from any thread: in-process on the main
    thread, in the helper process elsewhere (``fn`` must then be a module-level function).

    Returns:
        ``(value, timed_out)``; ``value`` is None when it timed out.
    """
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return call_with_deadline(fn, args, timeout_s)
    return _helper().call(fn, args, timeout_s)


def _check_options(timeout_s: float = 5.0) -> None:
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"reward 'math_verify': timeout_s must be positive, got {timeout_s!r}")


@REWARD_FUNCTIONS.register("math_verify", check_options=_check_options)
@needs_fields("answer")
def math_verify(prompt: str, response: str, sample: dict, *, timeout_s: float = 5.0) -> RewardOutput:
    """1.0 when the response's final answer equals ``sample["answer"]`` according to math-verify.

    The response is searched for ``\\boxed{}`` first, then other LaTeX (``$...$``, ``\\(...\\)``), then
    plain expressions. Several different boxed answers are read as a set, which does not equal a
    single gold value.

    Args:
        prompt: unused.
        response: generated text.
        sample: dataset row with an ``answer``: LaTeX with or without ``$...$`` (``\\frac{3}{4}``), or a
            number.
        timeout_s: seconds allowed for parsing and comparing, together; past it the score is 0.

    Returns:
        A ``RewardOutput`` with score 1.0 or 0.0 and ``info`` counters ``timeout`` (the deadline
        passed, or the helper process died) and ``no_answer`` (nothing could be extracted).

    Raises:
        KeyError: the row has no ``answer``.
        ValueError: the answer is empty or not finite, or ``timeout_s`` is not positive.
        ImportError: math-verify is not installed.
    """
    if "answer" not in sample:
        raise KeyError(
            f"reward 'math_verify' needs an 'answer' field in each dataset row; "
            f"this row has keys {sorted(map(str, sample))}"
        )
    _check_options(timeout_s)
    gold = gold_latex(sample["answer"])
    _extraction_config()  # a missing package is an ImportError here, not a timeout in the helper
    result, timed_out = run_with_deadline(grade, (gold, response), timeout_s)
    if timed_out:
        return RewardOutput(0.0, info={"timeout": 1.0, "no_answer": 0.0})
    found, correct = result
    return RewardOutput(1.0 if correct else 0.0, info={"timeout": 0.0, "no_answer": 0.0 if found else 1.0})
