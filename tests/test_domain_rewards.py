"""Domain rewards: math_verify (and its deadline on and off the main thread), countdown, the format and
regex rules, and the pure parts of the LLM judge."""

from __future__ import annotations

import inspect
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import roll.rewards.math as math_reward
from roll.rewards.base import REWARD_FUNCTIONS, RewardOutput, required_fields
from roll.rewards.countdown import MAX_EQUATION_CHARS, countdown, extract_equation
from roll.rewards.judge import (
    DEFAULT_JUDGE_TEMPLATE,
    parse_judge_score,
    render_judge_prompt,
    validate_judge_template,
)
from roll.rewards.rules import compile_rule_pattern, regex_match, think_answer_format

pytest.importorskip("math_verify")

# Deadlines for work that must finish (a grading, a helper's start, a thread's return): far above its
# need even on a loaded machine, so that only a broken reward reaches them.
ROOMY_S = 120.0
# Work that must be cut off runs this long, far past any deadline the tests set and any time they allow.
ENDLESS_S = 600.0
# Elapsed time that proves a deadline cut such work short, whatever the machine's load.
CUT_SHORT_S = 60.0


def _score(gold: object, response: str, **options: Any) -> RewardOutput:
    """The reward with a roomy deadline unless the test sets one: its subject is the grading, not the
    default deadline."""
    options.setdefault("timeout_s", ROOMY_S)
    return math_reward.math_verify("", response, {"answer": gold}, **options)


def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a fresh thread (not the main one), its result or exception passed back."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised below, on the test's thread
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(ROOMY_S)
    assert not thread.is_alive(), "the call did not return"
    if "error" in box:
        raise box["error"]
    return box["value"]


# Graders substituted for math_reward.grade. Module level, because off the main thread the helper
# process imports them by name from this module.
def _slow_grade(gold: str, response: str) -> tuple[bool, bool]:
    time.sleep(ENDLESS_S)
    return True, True


def _stuck_grade(gold: str, response: str) -> tuple[bool, bool]:
    # Stands for C code that never looks at signals: the deadline's alarm is simply lost.
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(ENDLESS_S)
    return True, True


def _stubborn() -> str:
    # Swallows the first deadline exception, as a broad ``except BaseException`` in a library would.
    try:
        time.sleep(ENDLESS_S)
    except BaseException:
        pass
    time.sleep(ENDLESS_S)
    return "finished"


@pytest.fixture(scope="module", autouse=True)
def _close_helper() -> Iterator[None]:
    yield
    math_reward._helper().close()


def test_registered_with_keyword_only_options() -> None:
    for name in ("math_verify", "countdown", "think_answer_format", "regex_match"):
        fn = REWARD_FUNCTIONS.get(name)
        options = list(inspect.signature(fn).parameters.values())[3:]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty for p in options)
    assert required_fields("math_verify") == ("answer",)
    assert required_fields("countdown") == ("numbers", "target")


# --- math_verify -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gold", "response", "expected"),
    [
        ("\\frac{1}{2}", "so the answer is \\boxed{0.5}", 1.0),
        ("0.5", "\\boxed{\\frac{2}{4}}", 1.0),
        ("$\\frac{1}{2}$", "The answer is $\\frac{2}{4}$.", 1.0),
        (0.5, "1/2", 1.0),
        ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0),
        (5, "The length is \\boxed{5\\text{ cm}}", 1.0),
        ("5\\text{ cm}", "\\boxed{5}", 1.0),
        ("-3", "\\boxed{-3}", 1.0),
        ("-3", "\\boxed{3}", 0.0),
        ("\\sqrt{2}", "$\\boxed{\\sqrt 2}$", 1.0),
        ("12", "The answer is 13.", 0.0),
        (1000, "\\boxed{1,000}", 1.0),
    ],
)
def test_math_verify_equivalences(gold: object, response: str, expected: float) -> None:
    out = _score(gold, response)
    assert out.score == expected
    assert out.info == {"timeout": 0.0, "no_answer": 0.0}


def test_math_verify_prefers_boxed_and_reads_several_boxes_as_a_set() -> None:
    # The boxed answer wins over earlier LaTeX in the text.
    assert _score("3", "First $x = 5$, then finally \\boxed{3}").score == 1.0
    assert _score("5", "First $x = 5$, then finally \\boxed{3}").score == 0.0
    # Two different boxes are the set {2, 3}, which equals neither; the same box twice is just 3.
    assert _score("3", "\\boxed{2}, no wait: \\boxed{3}").score == 0.0
    assert _score("2", "\\boxed{2}, no wait: \\boxed{3}").score == 0.0
    assert _score("3", "\\boxed{3}, checking: \\boxed{3}").score == 1.0


def test_math_verify_no_answer_is_counted() -> None:
    out = _score("3", "I am not sure how to solve this.")
    assert out.score == 0.0
    assert out.info == {"timeout": 0.0, "no_answer": 1.0}


def test_gold_is_wrapped_only_when_needed_and_bad_golds_are_errors() -> None:
    assert math_reward.gold_latex("\\frac{3}{4}") == "$\\frac{3}{4}$"
    assert math_reward.gold_latex(" $x$ ") == "$x$"
    assert math_reward.gold_latex(7) == "$7$"
    assert math_reward.gold_latex(1e-07) == "$0.0000001$"  # not '1e-07', which LaTeX reads as e - 7
    assert _score(1e-07, "\\boxed{10^{-7}}").score == 1.0
    for bad in ("", "  ", float("nan"), float("inf")):
        with pytest.raises(ValueError):
            _score(bad, "\\boxed{1}")
    with pytest.raises(KeyError, match="answer"):
        math_reward.math_verify("", "\\boxed{1}", {"question": "?"})
    with pytest.raises(ValueError, match="timeout_s"):
        _score("1", "\\boxed{1}", timeout_s=0)


def test_math_timeout_on_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify

    def slow_verify(*args: Any, **kwargs: Any) -> bool:
        time.sleep(ENDLESS_S)
        return True

    monkeypatch.setattr(math_verify, "verify", slow_verify)
    handler_before = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    out = _score("1", "\\boxed{1}", timeout_s=0.05)
    assert time.monotonic() - started < CUT_SHORT_S  # the deadline ended the endless comparison
    assert out.score == 0.0
    assert out.info == {"timeout": 1.0, "no_answer": 0.0}
    # Nothing is left behind: the handler is the caller's again and no timer is armed.
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_deadline_survives_swallowed_exception_and_keeps_enclosing_timer() -> None:
    fired: list[int] = []

    def outer_handler(signum: int, frame: object) -> None:
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, outer_handler)
    outer_s = 2 * ENDLESS_S  # never reached while the test runs
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, outer_s)
    try:
        value, timed_out = math_reward.call_with_deadline(_stubborn, (), 0.05)
        assert (value, timed_out) == (None, True)
        assert time.monotonic() - started < CUT_SHORT_S  # the refiring deadline got past the swallow
        assert signal.getsignal(signal.SIGALRM) is outer_handler
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        elapsed = time.monotonic() - started
        # The enclosing timer runs on with what was left of it: neither restarted nor lost.
        assert outer_s - elapsed - 0.5 < left <= outer_s - 0.05
        assert fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_math_verify_off_the_main_thread_uses_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify

    # math-verify's own timeout (signal.alarm) refuses to run off the main thread...
    with pytest.raises(ValueError, match="thread"):
        _in_thread(lambda: math_verify.parse("$1$"))
    # ...so there the reward sends the work to its helper process.
    assert _in_thread(lambda: _score("\\frac{1}{2}", "\\boxed{0.5}")).score == 1.0
    assert _in_thread(lambda: _score("2", "\\boxed{3}")).score == 0.0
    assert _in_thread(lambda: _score("2", "no idea")).info["no_answer"] == 1.0

    helper_pid = math_reward._helper()._proc.pid
    monkeypatch.setattr(math_reward, "grade", _slow_grade)
    # However slowly a loaded machine carries the helper's answer, it comes before the kill.
    monkeypatch.setattr(math_reward, "_KILL_GRACE_S", ROOMY_S)
    started = time.monotonic()
    out = _in_thread(lambda: _score("1", "\\boxed{1}", timeout_s=0.2))
    assert out.info == {"timeout": 1.0, "no_answer": 0.0}
    # Far sooner than the endless grading or the kill grace: the helper's own deadline answered ...
    assert time.monotonic() - started < CUT_SHORT_S
    # ... so it was not killed and restarted.
    assert math_reward._helper()._proc.pid == helper_pid


def test_stuck_helper_is_killed_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _in_thread(lambda: _score("1", "\\boxed{1}")).score == 1.0  # a helper is running
    monkeypatch.setattr(math_reward, "_KILL_GRACE_S", 0.3)
    monkeypatch.setattr(math_reward, "grade", _stuck_grade)
    helper_pid = math_reward._helper()._proc.pid
    started = time.monotonic()
    out = _in_thread(lambda: _score("1", "\\boxed{1}", timeout_s=0.1))
    assert out.info["timeout"] == 1.0
    assert time.monotonic() - started < CUT_SHORT_S  # killed, not waited for
    assert math_reward._helper()._proc.pid != helper_pid
    monkeypatch.undo()
    assert _in_thread(lambda: _score("1", "\\boxed{1}")).score == 1.0


def test_helper_that_cannot_start_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    math_reward._helper().close()
    monkeypatch.setattr(sys, "executable", shutil.which("false") or "/bin/false")
    with pytest.raises(RuntimeError, match="failed to start"):
        _in_thread(lambda: _score("1", "\\boxed{1}"))
    monkeypatch.undo()
    assert _in_thread(lambda: _score("1", "\\boxed{1}")).score == 1.0


def _not_importable_grade(gold: str, response: str) -> tuple[bool, bool]:
    return True, True


def test_helper_reports_errors_instead_of_dying(monkeypatch: pytest.MonkeyPatch) -> None:
    # A function the helper cannot import (pickled under a module name that does not exist there).
    monkeypatch.setattr(_not_importable_grade, "__module__", "no_such_module_here")
    monkeypatch.setitem(sys.modules, "no_such_module_here", sys.modules[__name__])
    monkeypatch.setattr(math_reward, "grade", _not_importable_grade)
    with pytest.raises(RuntimeError, match="no_such_module_here"):
        _in_thread(lambda: _score("1", "\\boxed{1}"))


# --- countdown ---------------------------------------------------------------------------------------

ROW = {"numbers": [3, 5, 2], "target": 17}


def _countdown(response: str, row: dict | None = None, **options: Any) -> RewardOutput:
    return countdown("", response, row or ROW, **options)


def _outcome(out: RewardOutput) -> str:
    flagged = [key for key, value in out.info.items() if value]
    return flagged[0] if flagged else "correct"


@pytest.mark.parametrize(
    ("response", "score", "outcome"),
    [
        ("3*5+2", 1.0, "correct"),
        ("(5 * 3) + 2", 1.0, "correct"),
        ("<think>try 3*5</think> <answer>3 * 5 + 2 = 17</answer>", 1.0, "correct"),
        ("<answer>3+5+2</answer> hmm, no: <answer>2+5*3</answer>", 1.0, "correct"),
        ("3*5+2 = 16", 1.0, "correct"),  # the claimed value is ignored; the equation decides
        ("3*5-2", 0.0, "wrong_value"),
        ("3*5+2+2", 0.0, "bad_numbers"),  # 2 reused
        ("3*5*1+2", 0.0, "bad_numbers"),  # 1 not given
        ("5*3", 0.0, "bad_numbers"),  # 2 unused, and use_all is on
        ("-3+5+2", 0.0, "bad_numbers"),  # -3 is a number of its own
        ("3**2+5+2", 0.0, "malformed"),
        ("3*5//2", 0.0, "malformed"),
        ("x+3+5+2", 0.0, "malformed"),
        ("abs(3)*5+2", 0.0, "malformed"),
        ("__import__('os')", 0.0, "malformed"),
        ("0x11", 0.0, "malformed"),
        ("3*5+2.0", 0.0, "malformed"),
        ("+3*5+2", 0.0, "malformed"),
        ("3*5+", 0.0, "malformed"),
        ("", 0.0, "malformed"),
        ("<answer></answer>", 0.0, "malformed"),
    ],
)
def test_countdown(response: str, score: float, outcome: str) -> None:
    out = _countdown(response)
    assert (out.score, _outcome(out)) == (score, outcome)


def test_countdown_options_and_division() -> None:
    assert _countdown("5*3+2", use_all=False).score == 1.0
    assert _countdown("15+2", {"numbers": [15, 2, 9], "target": 17}, use_all=False).score == 1.0
    assert _countdown("15+2+2", {"numbers": [15, 2, 9], "target": 17}, use_all=False).score == 0.0
    # Exact arithmetic: 7/2*2 is 7, not 6 or 7.000000001.
    assert _countdown("7/2*2", {"numbers": [7, 2, 2], "target": 7}).score == 1.0
    zero = _countdown("4/(2-2)", {"numbers": [4, 2, 2], "target": 1}, format_score=0.1)
    assert (zero.score, _outcome(zero)) == (0.1, "wrong_value")
    assert _countdown("3*5-2", format_score=0.1).score == 0.1
    assert _countdown("3**5", format_score=0.1).score == 0.0
    # Rows from parquet/NumPy or strings are read as integers.
    assert _countdown("3*5+2", {"numbers": ["3", 5.0, 2], "target": "17"}).score == 1.0
    with pytest.raises(ValueError, match="numbers"):
        _countdown("1", {"numbers": "352", "target": 17})
    with pytest.raises(ValueError, match="target"):
        _countdown("1", {"numbers": [1], "target": 1.5})
    with pytest.raises(KeyError, match="target"):
        _countdown("1", {"numbers": [1]})


def test_countdown_hostile_inputs_are_rejected_quickly() -> None:
    hostile = [
        "(" * 40 + "3*5+2" + ")" * 40,
        "(" * 5000 + "1" + ")" * 5000,
        "1+" * 100_000 + "1",
        "9" * 100_000,
        "<answer>" * 50_000,
        "= " * 100_000,
        "<answer>" + "-" * (MAX_EQUATION_CHARS - 1) + "1</answer>",
    ]
    # CPU time of this thread, not wall time: what the check costs, whatever else the machine runs. All
    # of them take milliseconds; a regex that rescanned the spam for every tag would take minutes.
    started = time.thread_time()
    for response in hostile:
        assert _outcome(_countdown(response)) == "malformed"
    assert time.thread_time() - started < 0.5


def test_extract_equation() -> None:
    assert extract_equation("  1 + 2 = 3 ") == "1 + 2"
    assert extract_equation("<answer> (1+2)*3 =9</answer>trailing") == "(1+2)*3"
    assert extract_equation("<answer>a</answer><answer>b</answer>") == "b"


# --- rules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>reasoning</think><answer>42</answer>", 1.0),
        ("\n<think>\nmulti\nline\n</think>\n\n<answer> 42 </answer>\n", 1.0),
        ("<think></think><answer>42</answer>", 1.0),
        ("<think>r</think><answer>  </answer>", 0.0),
        ("<answer>42</answer>", 0.0),
        ("<think>r</think>", 0.0),
        ("Sure! <think>r</think><answer>42</answer>", 0.0),
        ("<think>r</think><answer>42</answer> Hope that helps.", 0.0),
        ("<think>r</think> text <answer>42</answer>", 0.0),
        ("<answer>42</answer><think>r</think>", 0.0),
        ("<think>r</think><answer>4</answer><answer>2</answer>", 0.0),
        ("<think>r <answer>x</answer></think><answer>42</answer>", 0.0),
        ("<think>r</think><answer>42", 0.0),
    ],
)
def test_think_answer_format(response: str, expected: float) -> None:
    assert think_answer_format("", response, {}) == expected


def test_regex_match() -> None:
    assert regex_match("", "so \\boxed{7}.", {}, pattern=r"\\boxed\{\d+\}") == 1.0
    assert regex_match("", "so \\boxed{7}.", {}, pattern=r"\\boxed\{\d+\}", mode="fullmatch") == 0.0
    assert regex_match("", "\\boxed{7}", {}, pattern=r"\\boxed\{\d+\}", mode="fullmatch") == 1.0
    assert regex_match("", "a\nb", {}, pattern="a.b") == 0.0
    assert regex_match("", "a\nb", {}, pattern="(?s)a.b") == 1.0
    assert regex_match("", "ANSWER", {}, pattern="(?i)answer") == 1.0
    assert compile_rule_pattern("a+", "search") is compile_rule_pattern("a+", "search")
    with pytest.raises(ValueError, match="non-empty"):
        regex_match("", "x", {})
    with pytest.raises(ValueError, match="mode"):
        regex_match("", "x", {}, pattern="x", mode="match")
    with pytest.raises(ValueError, match="invalid pattern"):
        regex_match("", "x", {}, pattern="(unclosed")


# --- judge -------------------------------------------------------------------------------------------


def test_judge_prompt_rendering() -> None:
    validate_judge_template(DEFAULT_JUDGE_TEMPLATE)
    response = "By {response} and {0} and }{ and \\frac{1}{2}: {{x}}"
    prompt = render_judge_prompt(DEFAULT_JUDGE_TEMPLATE, "What is 1/2 of 1?", "\\frac{1}{2}", response)
    assert response in prompt
    assert "What is 1/2 of 1?" in prompt and "Score:" in prompt
    custom = 'Q: {question}\nRef: {reference}\nA: {response}\nJSON like {{"score": 1}}'
    assert render_judge_prompt(custom, "q", "r", "a") == 'Q: q\nRef: r\nA: a\nJSON like {"score": 1}'


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{question} {response}", "missing placeholder"),
        ("{question} {reference} {response} {answer}", "unknown placeholder"),
        ("{question} {reference} {response} {}", "unknown placeholder"),
        ("{question} {reference} {response!r}", "plain"),
        ("{question:>9} {reference} {response}", "plain"),
        ("{question} {reference} {response} }", "brace"),
        ("{question} {reference} {response} {", "brace"),
    ],
)
def test_judge_template_validation(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_judge_template(template)
    with pytest.raises(ValueError):
        render_judge_prompt(template, "q", "r", "a")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Equivalent.\nScore: 10", 1.0),
        ("Score: 7", 0.7),
        ("**Score:** 8/10", 0.8),
        ("score : 2.5.", 0.25),
        ("Score: 3\nOn reflection it is right.\nScore: 9", 0.9),
        ("Score: 9\nSorry: Score: 12", None),  # the last score decides, and it is out of range
        ("Score: -1", None),
        ("A score of 8 seems fair.", None),
        ("Score: <an integer from 0 to 10>", None),
        ("", None),
    ],
)
def test_parse_judge_score(reply: str, expected: float | None) -> None:
    assert parse_judge_score(reply) == expected


def test_parse_judge_score_scale() -> None:
    assert parse_judge_score("Score: 4", scale=5) == 0.8
    assert parse_judge_score("Score: 6", scale=5) is None
    with pytest.raises(ValueError, match="scale"):
        parse_judge_score("Score: 1", scale=0)
