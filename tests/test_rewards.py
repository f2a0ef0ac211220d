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


# --------------------------------------------------------------------------- process rewards


def process_reward(prompt: str, response: str, sample: dict, response_ids: list[int]) -> RewardOutput:
    """A toy process reward: 0.5 for every token id above 10, so its output follows the token ids."""
    per_token = [0.5 if t > 10 else 0.0 for t in response_ids]
    return RewardOutput(score=sum(per_token), token_rewards=per_token)


def test_a_reward_declaring_response_ids_receives_them(monkeypatch):
    seen: list = []

    def outcome(prompt: str, response: str, sample: dict) -> float:
        return 1.0

    def spy(prompt: str, response: str, sample: dict, response_ids: list[int]) -> float:
        seen.append(response_ids)
        return 0.0

    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_outcome", outcome)
    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_spy", spy)
    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_process", process_reward)
    # A 3-argument reward is still called with 3 arguments when ids are known.
    assert score_response("test_outcome", "p", "r", {}, response_ids=[1, 2]).score == 1.0
    score_response("test_spy", "p", "r", {}, response_ids=[7, 8, 9])
    score_response("test_spy", "p", "r", {})
    assert seen == [[7, 8, 9], None]
    out = score_response("test_process", "p", "r", {}, response_ids=[3, 12, 14])
    assert out.token_rewards == [0.0, 0.5, 0.5] and out.score == 1.0


def test_token_rewards_of_the_wrong_length_name_the_reward_and_both_lengths(monkeypatch):
    def two_tokens(prompt: str, response: str, sample: dict) -> RewardOutput:
        return RewardOutput(score=1.0, token_rewards=[0.5, 0.5])

    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_two_tokens", two_tokens)
    with pytest.raises(ValueError, match="'test_two_tokens'.*two_tokens.*2 token_rewards.*of 3 tokens"):
        score_response("test_two_tokens", "p", "r", {}, response_ids=[1, 2, 3])
    # Without the ids there is nothing to check against (the credit step checks the mask later).
    assert score_response("test_two_tokens", "p", "r", {}).token_rewards == [0.5, 0.5]
    assert score_response("test_two_tokens", "p", "r", {}, response_ids=[1, 2]).score == 1.0


def reward_worker(function: str):
    """A RewardWorker without Ray: compute_rewards only reads ``config``."""
    from roll.workers.reward import RewardWorker

    worker = RewardWorker.__new__(RewardWorker)
    worker.config = function
    return worker


def rows(n: int) -> dict:
    return {
        "prompt_text": ["1+1="] * n,
        "response_text": ["2", "3", "22"][:n],
        "sample": [{"answer": "2"}] * n,
    }


def test_reward_worker_passes_unpadded_response_ids_and_returns_token_rewards(monkeypatch):
    import torch

    from roll.data.batch import Batch

    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_process", process_reward)
    ids = torch.tensor([[12, 0, 0], [3, 11, 0], [20, 21, 2]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    batch = Batch(tensors={"response_ids": ids, "response_mask": mask}, non_tensors=rows(3))
    out = reward_worker("test_process").compute_rewards(batch)
    assert out["scores"].dtype == torch.float32
    assert out["scores"].tolist() == [0.5, 0.5, 1.0]
    # Padding (id 0, masked) is not handed to the reward, so each row's list has its own length.
    assert out["token_rewards"] == [[0.5], [0.0, 0.5], [0.5, 0.5, 0.0]]


def test_reward_worker_keeps_outcome_scores_and_reports_no_token_rewards():
    import torch

    from roll.data.batch import Batch

    worker = reward_worker("exact_match")
    out = worker.compute_rewards(Batch(non_tensors=rows(3)))
    assert out["scores"].tolist() == [1.0, 0.0, 0.0] and out["token_rewards"] == [None, None, None]
    # With ids in the batch a 3-argument reward scores the same; an evaluation reward can be named.
    batch = Batch(
        tensors={"response_ids": torch.ones(3, 2, dtype=torch.long), "response_mask": torch.ones(3, 2)},
        non_tensors=rows(3),
    )
    assert worker.compute_rewards(batch)["scores"].tolist() == [1.0, 0.0, 0.0]
    assert worker.compute_rewards(batch, "char_match")["scores"].tolist() == pytest.approx([1.0, 0.0, 0.5])


def test_reward_worker_rejects_token_rewards_that_miss_tokens(monkeypatch):
    import torch

    from roll.data.batch import Batch

    def one_token(prompt: str, response: str, sample: dict) -> RewardOutput:
        return RewardOutput(score=1.0, token_rewards=[1.0])

    monkeypatch.setitem(REWARD_FUNCTIONS._entries, "test_one_token", one_token)
    batch = Batch(
        tensors={"response_ids": torch.tensor([[5, 6]]), "response_mask": torch.tensor([[1, 1]])},
        non_tensors=rows(1),
    )
    with pytest.raises(ValueError, match="'test_one_token'.*1 token_rewards for a response of 2 tokens"):
        reward_worker("test_one_token").compute_rewards(batch)
