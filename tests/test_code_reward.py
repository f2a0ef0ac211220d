"""The ``code_tests`` reward: extraction, both test styles, scoring modes, malformed rows, and hostile
programs that must score 0 without spoiling the next run."""

from __future__ import annotations

import math
import textwrap

import pytest
from sandbox_required import skip_without_sandbox

from roll.rewards import REWARD_FUNCTIONS, RewardOutput, score_response
from roll.rewards import code as code_reward
from roll.rewards.code import code_tests, extract_program, normalize_output, parse_tests, values_match
from roll.sandbox import SandboxResult, SandboxUnavailable, resolve_isolation

LINEAR = {
    "tests": [{"call": f"f({x})", "expected": 2 * x + 14} for x in range(4)],
    "code_prefix": "f=lambda x:",
}
ADD = {"tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 -4\n", "stdout": "6"}]}
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
SQUARE = {"tests": [{"call": f"square({x})", "expected": x * x} for x in (1, 2, 3, 4)]}
GOOD_SQUARE = "```python\ndef square(x):\n    return x * x\n```"


@pytest.fixture(scope="module")
def sandbox() -> None:
    """Skips tests that run programs where no namespaced isolation works: some of them are fork bombs."""
    try:
        resolve_isolation("auto")
    except SandboxUnavailable as e:
        skip_without_sandbox(f"no sandbox isolation here: {e}")


in_sandbox = pytest.mark.usefixtures("sandbox")


# Programs that must finish get far more time than they need, even on a loaded machine, where starting a
# sandbox can take seconds.
ROOMY_S = 120.0
# Programs that loop forever get a short timeout, which they always reach. Not a whole number: the reward's
# CPU limit, ceil(timeout_s) = 2 s, then trails the wall clock by half a second, so the loop is stopped
# (and counted) as the timeout it is, not by the CPU limit.
ENDLESS_TIMEOUT_S = 1.5


def reward(response: str, sample: dict, **options) -> RewardOutput:
    return code_tests("prompt", response, sample, timeout_s=options.pop("timeout_s", ROOMY_S), **options)


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{textwrap.dedent(code)}```\nIt squares its input."


# ------------------------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("x = 1", "x = 1"),  # no fence: the whole response
        ("```python\nx = 1\n```", "x = 1\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```\nx = 1\n```", "x = 1\n"),  # untagged
        ("```python\nx = 1\n```\ntext\n```python\nx = 2\n```", "x = 2\n"),  # the last one
        ("```python\nx = 1\n```\n```text\noutput\n```", "x = 1\n"),  # other languages are skipped
        ("```bash\nls\n```", "```bash\nls\n```"),  # no python block at all: the whole response
        ("Sure.\n```python\nx = 3\n", "x = 3\n"),  # cut off before the closing fence
    ],
)
def test_extract_program(response, program):
    assert extract_program(response) == program


def test_values_match():
    assert values_match(0.30000000000000004, 0.3)
    assert not values_match(0.31, 0.3)
    assert values_match(2, 2.0) and values_match(float("nan"), math.nan)
    assert not values_match(True, 1) and not values_match(1, True) and values_match(False, False)
    assert values_match([1, [2, {"a": 3.0}]], [1, [2, {"a": 3}]])
    assert not values_match({"a": 1}, {"a": 1, "b": 2}) and not values_match([1, 2], [1, 2, 3])
    assert not values_match("1", 1) and not values_match(None, 0) and values_match(None, None)
    assert not values_match(10**400, 1.0)  # too large for a float: unequal, not an error


def test_normalize_output():
    assert normalize_output("3  \n\n\n") == normalize_output("3") == "3"
    assert normalize_output(" a\t\nb \n") == " a\nb"  # leading whitespace counts


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        ([], "non-empty list"),
        ({"call": "f(1)", "expected": 1}, "non-empty list"),
        ("not json", "not JSON"),
        (["f(1)"], "must be a dict"),
        ([{"call": "f(1)"}], "exactly the keys"),
        ([{"call": "f(1)", "expected": 1, "stdin": ""}], "exactly the keys"),
        ([{"call": "", "expected": 1}], "non-empty string"),
        ([{"call": "f(1", "expected": 1}], "not a Python expression"),
        ([{"call": "f(1)", "expected": {1, 2}}], "JSON value"),
        ([{"stdin": 1, "stdout": "1"}], "must be strings"),
    ],
)
def test_malformed_tests_name_the_problem(tests, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(tests)
    with pytest.raises(ValueError, match=message):
        reward("x = 1", {"tests": tests})


def test_tests_given_as_a_json_string():
    cases = parse_tests('[{"call": "f(1)", "expected": [1, 2]}, {"stdin": "", "stdout": "x"}]')
    assert [type(c).__name__ for c in cases] == ["CallCase", "IOCase"]


def test_bad_options_and_missing_field():
    check = REWARD_FUNCTIONS.traits("code_tests")["check_options"]
    for bad in ({"mode": "most"}, {"timeout_s": 0}, {"memory_mb": 8}, {"isolation": "docker"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            check(**bad)
        with pytest.raises(ValueError):
            reward(GOOD_SQUARE, SQUARE, **bad)
    with pytest.raises(KeyError, match="'tests'"):
        reward(GOOD_SQUARE, {"answer": 1})


# ------------------------------------------------------------------------------------- in the sandbox


@in_sandbox
def test_function_calls_right_wrong_and_malformed_answers():
    assert reward("2*x+14", LINEAR).score == 1.0  # the row's code_prefix makes it f=lambda x:2*x+14
    out = reward("2*x+15", LINEAR)
    assert out.score == 0.0 and out.info == {
        "passed_frac": 0.0,
        "timeout": 0.0,
        "sandbox_error": 0.0,
        "left_processes": 0.0,
    }
    assert reward("2*x+", LINEAR).score == 0.0  # does not compile
    assert reward(GOOD_SQUARE, SQUARE).score == 1.0
    assert reward(fenced("def square(x):\n    return x ** 3\n"), SQUARE).score == 0.25  # right for 1 only


@in_sandbox
def test_fraction_and_all_modes():
    # Right for 1 and 2, a crash for 3 (only that call fails), wrong for 4.
    partly = fenced(
        """\
        def square(x):
            if x == 3:
                raise ValueError
            return x * x if x < 3 else 0
        """
    )
    out = reward(partly, SQUARE)
    assert out.score == 0.5 and out.info["passed_frac"] == 0.5
    out = reward(partly, SQUARE, mode="all")
    assert out.score == 0.0 and out.info["passed_frac"] == 0.5
    assert reward(GOOD_SQUARE, SQUARE, mode="all").score == 1.0


@in_sandbox
def test_stdin_stdout_cases():
    assert reward(fenced(ADD_PROGRAM), ADD).score == 1.0
    trailing = "a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\n"  # trailing blanks ignored
    assert reward(trailing, ADD).score == 1.0
    assert reward("print(3)", ADD).score == 0.5
    assert reward("print(3)", ADD, mode="all").score == 0.0
    assert reward("import sys; print(3); sys.exit(1)", ADD).score == 0.0  # right output, failing exit


@in_sandbox
def test_mixed_styles_and_score_response():
    sample = {"tests": [*SQUARE["tests"], {"stdin": "5\n", "stdout": "25\n"}]}
    program = fenced(
        """\
        def square(x):
            return x * x

        if __name__ == "__main__":  # the stdin/stdout case runs it as a script
            print(square(int(input())))
        """
    )
    out = score_response("code_tests", "prompt", program, sample)
    assert out.score == 1.0 and out.info["passed_frac"] == 1.0


@in_sandbox
def test_a_syntax_error_is_run_once(monkeypatch):
    runs = []
    real = code_reward.run_python

    def counting(*args, **kwargs):
        runs.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(code_reward, "run_python", counting)
    assert reward("print(", ADD).score == 0.0
    assert len(runs) == 1


def test_a_failing_sandbox_is_counted_not_blamed(monkeypatch):
    broken = SandboxResult("", "", None, False, False, 0.0, error="set-up failed")
    monkeypatch.setattr(code_reward, "run_python", lambda *a, **k: broken)
    out = reward(GOOD_SQUARE, SQUARE)
    assert out.score == 0.0 and out.info["sandbox_error"] == 1.0


# ------------------------------------------------------------------------------------------- hostile


@in_sandbox
@pytest.mark.parametrize(
    ("name", "program", "timed_out"),
    [
        ("infinite loop", "while True:\n    pass\n", 1.0),
        ("loop in a call", "def square(x):\n    while True:\n        pass\n", 1.0),
        ("fork bomb", "import os\nwhile True:\n    os.fork()\n", 0.0),
        ("memory bomb", "hog = bytearray(1 << 34)\n", 0.0),
        (
            "fake result lines",
            # Prints lines shaped like results, writes them on every descriptor, then forges results
            # through the harness's own send() (found on the stack) and leaves before the real ones.
            """\
            import os, sys
            for fd in range(1, 20):
                try:
                    os.write(fd, b"%s ok 1\\n" % os.urandom(16).hex().encode())
                except OSError:
                    pass
            send = sys._getframe(1).f_locals["send"]
            for i in range(4):
                send(i, "ok", "0")
            os._exit(0)
            """,
            0.0,
        ),
        (
            "always-equal objects",
            """\
            class Yes:
                def __eq__(self, other):
                    return True
            class YesInt(int):
                def __eq__(self, other):
                    return True
                __hash__ = int.__hash__
            def square(x):
                return Yes() if x % 2 else YesInt(0)
            """,
            0.0,
        ),
        ("exit before the calls", "import os\nos._exit(0)\n", 0.0),
        ("raise SystemExit(1)", "raise SystemExit(1)\ndef square(x):\n    return x * x\n", 0.0),
    ],
)
def test_hostile_programs_score_zero_and_the_next_still_scores(name, program, timed_out):
    # Only the endless loops may time out; the others must end on their own, however slowly.
    timeout_s = ENDLESS_TIMEOUT_S if timed_out else ROOMY_S
    out = reward(fenced(program), SQUARE, timeout_s=timeout_s, memory_mb=256)
    assert out.score == 0.0, name
    assert out.info["timeout"] == timed_out and out.info["sandbox_error"] == 0.0
    assert reward(GOOD_SQUARE, SQUARE).score == 1.0


@in_sandbox
def test_the_nonces_stay_out_of_the_programs_reach(monkeypatch):
    """A program that searches its memory, descriptors and parent for the nonces finds none."""
    nonces = iter(f"{i:032x}" for i in range(1000, 1010))
    monkeypatch.setattr(code_reward.secrets, "token_hex", lambda n: next(nonces))
    seen = []
    real = code_reward.run_python

    def recording(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(code_reward, "run_python", recording)
    program = """\
        import gc, glob, os, sys
        found = [o for o in gc.get_objects() if isinstance(o, (list, dict)) and "0" * 28 in repr(o)]
        print("memory:", found, file=sys.stderr)
        parent = "/proc/%d/" % os.getppid()
        for path in [parent + "cmdline", parent + "environ", parent + "mem", *glob.glob(parent + "fd/*")]:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                print(path, os.read(fd, 4096), file=sys.stderr)
            except OSError as exc:
                print(path, type(exc).__name__, file=sys.stderr)
        try:
            with open("/proc/%d/fd/1" % os.getppid(), "w") as f:
                f.write("%032x ok 1\\n" % 1000)
        except OSError as exc:
            print("reopen parent stdout:", type(exc).__name__, file=sys.stderr)
        def square(x):
            return -1
        """
    out = reward(fenced(program), SQUARE)
    assert out.score == 0.0
    (run,) = seen
    assert "reopen parent stdout: PermissionError" in run.stderr
    assert "0" * 28 not in run.stderr
    assert len(run.stdout.splitlines()) == 4  # one line per call, from the harness only
