"""Hand-checked examples for the reward functions and the reward contract."""

from __future__ import annotations

import pytest

from roll.rewards import REWARD_FUNCTIONS, RewardOutput, score_response
from roll.rewards.match import first_number


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        (" 42\n", 42, 1.0),  # surrounding whitespace ignored; answer converted with str()
        ("42", " 42 ", 1.0),
        ("41", "42", 0.0),
        ("42.0", "42", 0.0),  # exact text, not numeric, comparison
        ("The answer is 42", "42", 0.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert REWARD_FUNCTIONS.get("exact_match")("prompt", response, {"answer": answer}) == expected


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is -3.5 apples", "-3.5", 1.0),
        ("+7", 7, 1.0),
        ("42.0", "42", 1.0),
        ("about .5 of it", 0.5, 1.0),
        ("1e3", "1000", 1.0),
        ("0.1234567", "0.1234568", 1.0),  # |diff| = 1e-7 <= 1e-6
        ("0.12345", "0.12346", 0.0),  # |diff| = 1e-5
        ("x = 12, y = 5", "5", 0.0),  # only the first number counts
        ("no number here", "5", 0.0),
        ("", "0", 0.0),
    ],
)
def test_numeric_match(response, answer, expected):
    assert REWARD_FUNCTIONS.get("numeric_match")("prompt", response, {"answer": answer}) == expected


def test_first_number():
    assert first_number("x: -2.50e1 then 3") == -25.0
    assert first_number("none") is None


@pytest.mark.parametrize("name", ["exact_match", "numeric_match", "char_match"])
def test_missing_answer_names_the_reward_and_the_row_keys(name):
    with pytest.raises(KeyError) as info:
        REWARD_FUNCTIONS.get(name)("p", "1", {"question": "1 + 0?", "solution": "1"})
    message = str(info.value)
    assert f"'{name}'" in message and "'answer'" in message
    assert "question" in message and "solution" in message


def test_numeric_match_rejects_non_numeric_answer():
    with pytest.raises(ValueError, match="numeric 'answer'"):
        REWARD_FUNCTIONS.get("numeric_match")("p", "1", {"answer": "one"})


def test_score_response_normalises_floats_and_passes_reward_outputs(monkeypatch):
    assert score_response("exact_match", "p", "7", {"answer": 7}) == RewardOutput(score=1.0)

    def with_tokens(prompt: str, response: str, sample: dict) -> RewardOutput:
        return RewardOutput(score=0.5, token_rewards=[0.0, 0.5], info={"parsed": response})

    def boolean(prompt: str, response: str, sample: dict) -> bool:
        return True

    # setitem on the entries dict removes the test entries again after the test.
    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_with_tokens", with_tokens)
    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_boolean", boolean)
    out = score_response("test_with_tokens", "p", "ab", {})
    assert out.score == 0.5 and out.token_rewards == [0.0, 0.5] and out.info == {"parsed": "ab"}
    out = score_response("test_boolean", "p", "ab", {})
    assert out == RewardOutput(score=1.0) and type(out.score) is float


def test_score_response_rejects_other_return_types(monkeypatch):
    def returns_text(prompt: str, response: str, sample: dict) -> str:
        return "1.0"

    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_returns_text", returns_text)
    with pytest.raises(
        TypeError, match="'test_returns_text'.*returns_text.*str '1.0'.*float or a RewardOutput"
    ):
        score_response("test_returns_text", "p", "r", {})


def test_unknown_reward_suggests_the_closest():
    with pytest.raises(KeyError, match="Did you mean 'exact_match'"):
        score_response("exact-match", "p", "r", {"answer": 1})


def test_reward_output_defaults_are_not_shared():
    first, second = RewardOutput(score=1.0), RewardOutput(score=2.0)
    first.info["x"] = 1
    assert second.info == {} and second.token_rewards is None


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("152", "152", 1.0),
        (" 152 ", "152", 1.0),
        ("153", "152", 2 / 3),  # two of three digits in place
        ("15", "152", 2 / 3),  # a missing digit counts against the longer string
        ("1520", "152", 3 / 4),  # so does an extra one
        ("999", "152", 0.0),
        ("", "7", 0.0),
    ],
)
def test_char_match_gives_partial_credit(response, answer, expected):
    assert score_response("char_match", "", response, {"answer": answer}).score == pytest.approx(expected)


def test_rewards_declare_the_row_fields_they_read(monkeypatch):
    from roll.rewards import needs_fields, required_fields

    assert required_fields("exact_match") == ("answer",)
    assert required_fields("exact_match", "char_match") == ("answer",)  # no duplicates

    @needs_fields("tests", "language")
    def runs_tests(prompt: str, response: str, sample: dict) -> float:
        return 0.0

    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "runs_tests", runs_tests)
    assert required_fields("runs_tests", "exact_match") == ("tests", "language", "answer")
