"""The LLM-judge reward: a real (tiny) judge model loaded from a local path, its reply parsed."""

from __future__ import annotations

import pytest

from roll.rewards import score_response
from roll.rewards.judge import _Judge, _judge
from roll.rewards.spec import RewardSpec, check_spec

TEMPLATE = "{question}+{reference}+{response}"


def test_a_judge_reply_without_a_score_scores_zero_and_is_counted(tiny_model_path: str) -> None:
    _judge.cache_clear()
    options = {"model_path": tiny_model_path, "template": TEMPLATE, "max_new_tokens": 4}
    # The tiny judge knows only digits and '+': it cannot write "Score:", so its reply never parses.
    out = score_response("llm_judge", "1+1", "2", {"answer": "2"}, options=options)
    assert (out.score, out.info) == (0.0, {"judge_unparsed": 1.0})
    assert _judge.cache_info().currsize == 1  # loaded once, reused by the next call
    score_response("llm_judge", "1+1", "3", {"answer": "2"}, options=options)
    assert _judge.cache_info().hits >= 1


def test_the_judges_last_score_is_the_reward(tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def replies(self: _Judge, prompts: list[str], max_new_tokens: int) -> list[str]:
        asked.extend(prompts)
        return ["Same result. Score: 3\nOn reflection, equivalent. Score: 8"] * len(prompts)

    monkeypatch.setattr(_Judge, "replies", replies)
    options = {"model_path": tiny_model_path, "template": TEMPLATE}
    out = score_response("llm_judge", "ignored", "{x}", {"prompt": "1+1", "answer": "2"}, options=options)
    assert out.score == pytest.approx(0.8) and out.info == {"judge_unparsed": 0.0}
    assert asked == ["1+1+2+{x}"]  # the row's question, the reference, the response (braces kept)


def test_a_domains_rows_reach_the_judge_in_one_batch(tiny_model_path: str, monkeypatch) -> None:
    from roll.rewards.spec import RewardSpec, score_all

    calls = []
    real = _Judge.replies

    def counting(self: _Judge, prompts: list[str], max_new_tokens: int) -> list[str]:
        calls.append(len(prompts))
        return real(self, prompts, max_new_tokens)  # the real batched generation, left-padded

    monkeypatch.setattr(_Judge, "replies", counting)
    options = {"model_path": tiny_model_path, "template": TEMPLATE, "max_new_tokens": 3}
    spec = RewardSpec({"llm_judge": 1.0, "exact_match": 1.0}, options={"llm_judge": options})
    outs = score_all(spec, ["1+1", "22+3"], ["2", "9"], [{"answer": "2"}, {"answer": "25"}])
    assert calls == [2]
    assert [o.score for o in outs] == [1.0, 0.0]  # the judge's unparsable replies add 0; exact_match adds 1
    assert [o.info["judge_unparsed"] for o in outs] == [1.0, 1.0]


def test_judge_options_are_checked_at_load(tiny_model_path: str, tmp_path) -> None:
    def problems(**options: object) -> list[str]:
        return check_spec("domains.open", RewardSpec({"llm_judge": 1.0}, options={"llm_judge": options}))

    assert "needs the option model_path" in problems()[0]
    assert "Cannot load a model from" in problems(model_path=str(tmp_path))[0]
    assert "unknown placeholder {answer}" in problems(model_path=tiny_model_path, template="{answer}")[0]
    assert (
        "max_new_tokens must be a positive integer"
        in problems(model_path=tiny_model_path, max_new_tokens=0)[0]
    )
    assert problems(model_path=tiny_model_path) == []
