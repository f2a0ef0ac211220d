"""Tool-call metrics over episodes and the monitor that stops a run whose tool calls mostly fail."""

from __future__ import annotations

import pytest

from roll.data.chat_turns import ChatTurns
from roll.envs.base import TextEnv
from roll.models.tokenizer import build_char_tokenizer
from roll.rollout.episode import Episode, EpisodeBudget
from roll.rollout.episodes import episode_metrics
from roll.rollout.tool_calls import MIN_CALLS, ToolFailureError, ToolFailureMonitor, tool_metrics

TOKENIZER = build_char_tokenizer("ca0123456789 :ToolerGd")
EOS = TOKENIZER.eos_token_id


class ToyTool(TextEnv):
    """'c' calls a tool that fails when ``broken`` (timing out when ``hangs``); 'a' answers and ends."""

    def __init__(self, broken: bool = False, hangs: bool = False):
        self.broken, self.hangs = broken, hangs

    def reset(self, seed):
        return "Go", {}

    def step(self, action_text):
        if action_text == "a":
            return "", 1.0, True, False, {"metrics": {"success": 1.0, "tool_calls": 0}}
        failed = self.broken or self.hangs
        counts = {"tool_calls": 1, "tool_failures": int(failed), "tool_timeouts": int(self.hangs)}
        return ("Tool error: 0" if failed else "42"), 0.0, False, False, {"metrics": counts}


def play(env: TextEnv, actions: str) -> Episode:
    episode = Episode(env, 0, ChatTurns(TOKENIZER, [EOS]), EpisodeBudget(8, 4, 400))
    episode.start()
    for action in actions:
        episode.add_turn([TOKENIZER.convert_tokens_to_ids(action), EOS], [0.0, 0.0], [0, 0], "stop")
    return episode


def test_tool_metrics_count_calls_failures_and_use() -> None:
    episodes = [play(ToyTool(), "cca"), play(ToyTool(broken=True), "ca"), play(ToyTool(), "a")]
    metrics = tool_metrics(episodes, "tool")
    assert metrics == pytest.approx(
        {
            "tool/use_rate": 2 / 3,  # two episodes of three called a tool
            "tool/calls_per_episode": 1.0,  # 3 calls over 3 episodes
            "tool/failure_frac": 1 / 3,
            "tool/timeout_frac": 0.0,
        }
    )
    assert episode_metrics(episodes, "episode")["tool/use_rate"] == pytest.approx(2 / 3)
    assert "eval/sampled/tool/failure_frac" in episode_metrics(episodes, "eval/sampled")
    # An env without tools reports no call count: no tool metrics at all.
    assert tool_metrics([play(NoTools(), "aa")], "tool") == {}


class NoTools(TextEnv):
    def reset(self, seed):
        return "Go", {}

    def step(self, action_text):
        return "Go", 0.0, False, False, {"metrics": {"success": 0.0}}


def test_the_monitor_stops_a_run_whose_tool_calls_mostly_fail() -> None:
    monitor = ToolFailureMonitor(max_failure_frac=0.5)
    # Below the number of calls it judges from, even all-failing calls pass (a policy that rarely calls).
    monitor.observe([play(ToyTool(hangs=True), "cca")] * 5)  # 10 calls, all failed
    with pytest.raises(ToolFailureError, match=r"(?s)20 of the last 20 tool calls failed.*Tool error: 0"):
        monitor.observe([play(ToyTool(hangs=True), "cca")] * (MIN_CALLS // 2 - 5))


def test_the_monitor_passes_healthy_and_half_failing_runs_and_can_be_off() -> None:
    healthy = ToolFailureMonitor(0.5)
    for _ in range(10):
        healthy.observe([play(ToyTool(), "cca")] * 3 + [play(ToyTool(broken=True), "ca")] * 2)  # 2 of 8 fail
    half = ToolFailureMonitor(0.5)
    for _ in range(10):  # exactly half is not "more than half"
        half.observe([play(ToyTool(), "ca")] * 2 + [play(ToyTool(broken=True), "ca")] * 2)
    off = ToolFailureMonitor(None)
    for _ in range(10):
        off.observe([play(ToyTool(broken=True), "ccca")] * 4)
    # Old steps leave the window: a broken first step (8 failed calls) is forgotten after 5 healthy ones.
    recovering = ToolFailureMonitor(0.5)
    recovering.observe([play(ToyTool(broken=True), "cca")] * 4)
    for _ in range(5):
        recovering.observe([play(ToyTool(), "ca")] * 4)
    assert len(recovering._steps) == 5 and sum(f for _, f in recovering._steps) == 0
    # The healthy and the half-failing runs were judged (enough calls), and passed.
    assert sum(c for c, _ in healthy._steps) >= MIN_CALLS and sum(c for c, _ in half._steps) >= MIN_CALLS
