"""The tool-use environment: calls, answers and their rewards; malformed calls, failing and hanging tools
each handled and counted; a calculator no expression can hang; python only in the sandbox; seeded
questions with held-out ones apart; the scripted expert; the example recipe's alphabet."""

from __future__ import annotations

import pytest
from sandbox_required import skip_without_sandbox

from roll.config import load_config
from roll.envs import tools
from roll.envs.agents import make_agent, play
from roll.envs.base import check_env, make_env
from roll.envs.seeds import held_out_seeds, training_seeds
from roll.envs.tool_use import ToolUse, question_for
from roll.sandbox import SandboxResult, SandboxUnavailable, resolve_isolation

METRICS = {"tool_calls", "tool_failures", "tool_timeouts", "success"}


def counts(info: dict) -> tuple[float, float, float]:
    assert set(info["metrics"]) == METRICS  # every step reports every counter
    metrics = info["metrics"]
    return metrics["tool_calls"], metrics["tool_failures"], metrics["tool_timeouts"]


@pytest.fixture(scope="module")
def sandbox() -> None:
    try:
        resolve_isolation("auto")
    except SandboxUnavailable as e:
        skip_without_sandbox(f"no sandbox isolation here: {e}")


in_sandbox = pytest.mark.usefixtures("sandbox")


def test_a_right_call_then_the_right_answer() -> None:
    env = ToolUse()
    question, _ = env.reset(0)
    a, b = question_for(0, 2)
    assert question == f"{a}*{b}" and 10 <= a <= 99 and 10 <= b <= 99
    observation, reward, done, truncated, info = env.step(f"c{a}*{b}")
    assert observation == f"={a * b}" and reward == 0.0 and not done and not truncated
    assert info["action_is_valid"] and counts(info) == (1.0, 0.0, 0.0)
    observation, reward, done, _, info = env.step(f" a{a * b}\n")
    assert reward == 1.0 and done and info["metrics"]["success"] == 1.0 and counts(info) == (0.0, 0.0, 0.0)


def test_a_wrong_answer_ends_the_episode_with_nothing() -> None:
    env = ToolUse()
    env.reset(0)
    a, b = question_for(0, 2)
    _, reward, done, _, info = env.step(f"a{a * b + 1}")
    assert reward == 0.0 and done and info["action_is_valid"] and info["metrics"]["success"] == 0.0


@pytest.mark.parametrize(
    "turn",
    ["c", "c37*", "cabs(-3)", "c__import__('os')", "cx", "z12", "", "a", "a12x", "a1.5", "pprint(1)"],
)
def test_a_malformed_turn_is_an_invalid_action_not_a_tool_failure(turn: str) -> None:
    env = ToolUse(tools=["calculator"])  # python not enabled: "pprint(1)" names no tool it may call
    question, _ = env.reset(3)
    observation, reward, done, _, info = env.step(turn)
    assert not info["action_is_valid"] and reward == pytest.approx(-0.1) and not done
    assert observation.startswith("Invalid action.") and observation.endswith(question)
    assert counts(info) == (0.0, 0.0, 0.0)
    # The call budget is untouched and the episode goes on.
    _, _, _, _, info = env.step("c2*3")
    assert info["action_is_valid"] and counts(info) == (1.0, 0.0, 0.0)


def test_a_failing_tool_says_so_and_the_episode_goes_on() -> None:
    env = ToolUse(max_tool_calls=2)
    env.reset(0)
    observation, reward, done, _, info = env.step("c1/0")
    assert observation == "Tool error: division by zero" and reward == 0.0 and not done
    assert info["action_is_valid"] and counts(info) == (1.0, 1.0, 0.0)
    a, b = question_for(0, 2)
    observation, _, _, _, info = env.step(f"c{a}*{b}")
    assert observation == f"={a * b}" and counts(info) == (1.0, 0.0, 0.0)


def test_calls_past_the_budget_are_invalid() -> None:
    env = ToolUse(max_tool_calls=1)
    env.reset(0)
    env.step("c1+1")
    observation, reward, _, _, info = env.step("c2+2")
    assert not info["action_is_valid"] and reward == pytest.approx(-0.1)
    assert "No tool calls left" in observation
    assert counts(info) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37*48", "1776"),
        ("2**-3", "0.125"),
        ("1/3", "0.333333333333"),
        ("-7%3", "2"),
        ("7//2", "3"),
        ("(1+2)*-3", "-9"),
        ("1.5*2", "3"),
        ("0.1+0.2", "0.3"),
        ("10**150", "1" + "0" * 150),
    ],
)
def test_the_calculator_is_exact(expression: str, value: str) -> None:
    assert tools.calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9",
        "2**10**100",
        "10**10**10**10",
        "(10**100)**(10**100)",
        "2**513",
        "(1/2)**600",
        "99999999999999999999**30",
        "(99999999999999999999*99999999999999999999)**9",
        "0**-1",
        "2**0.5",
    ],
)
def test_the_calculator_refuses_huge_or_undefined_results_without_computing_them(expression: str) -> None:
    with pytest.raises(tools.ToolFailure):
        tools.calculate(expression)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "abs(-1)",
        "[1]*9",
        "1 if 1 else 2",
        "x",
        "0x11",
        "1e9",
        "1_000",
        "(" * 20 + "1" + ")" * 20,
        "1+" * 150 + "1",
        "",
        "1 < 2",
        "'1'*9",
    ],
)
def test_the_calculator_reads_nothing_but_arithmetic(expression: str) -> None:
    with pytest.raises(tools.MalformedCall):
        tools.calculate(expression)


# A generous timeout where a program must finish: a loaded machine may take a while to start the sandbox.
ROOMY_S = 60.0


@in_sandbox
def test_python_runs_in_the_sandbox_and_its_stdout_comes_back() -> None:
    env = ToolUse(tools=["calculator", "python"], tool_timeout_s=ROOMY_S)
    env.reset(0)
    # The sandbox's private work directory and scrubbed environment, seen from inside.
    observation, _, _, _, info = env.step("pimport os\nprint(os.getcwd(), sorted(os.environ))\nprint(6*7)")
    assert info["action_is_valid"] and counts(info) == (1.0, 0.0, 0.0)
    assert observation == "=/tmp/sandbox ['HOME', 'LANG', 'PATH']\n42"


@in_sandbox
def test_a_raising_program_is_a_tool_failure_with_its_error() -> None:
    env = ToolUse(tools=["python"], tool_timeout_s=ROOMY_S)
    env.reset(0)
    observation, reward, done, _, info = env.step("p1/0")
    assert observation == "Tool error: ZeroDivisionError: division by zero" and reward == 0.0 and not done
    assert counts(info) == (1.0, 1.0, 0.0)


@in_sandbox
def test_a_hanging_program_times_out_and_the_episode_goes_on() -> None:
    env = ToolUse(tools=["calculator", "python"], tool_timeout_s=0.5, max_tool_calls=2)
    env.reset(0)
    observation, reward, done, _, info = env.step("pwhile True: pass")
    assert observation == "Tool error: timed out after 0.5 s" and reward == 0.0 and not done
    assert counts(info) == (1.0, 1.0, 1.0)
    a, b = question_for(0, 2)
    observation, _, _, _, info = env.step(f"c{a}*{b}")
    assert observation == f"={a * b}" and counts(info) == (1.0, 0.0, 0.0)
    _, reward, done, _, info = env.step(f"a{a * b}")
    assert reward == 1.0 and done and info["metrics"]["success"] == 1.0


def test_a_sandbox_that_fails_or_is_missing_is_a_tool_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(code: str, **_: object) -> SandboxResult:
        return SandboxResult("", "", None, False, False, 0.0, error="unshare: permission denied")

    def missing(code: str, **_: object) -> SandboxResult:
        raise SandboxUnavailable("no namespaced isolation works here")

    env = ToolUse(tools=["python"], max_tool_calls=2)
    env.reset(0)
    monkeypatch.setattr(tools, "run_python", broken)
    observation, _, done, _, info = env.step("pprint(1)")
    assert observation == "Tool error: the sandbox failed: unshare: permission denied" and not done
    assert counts(info) == (1.0, 1.0, 0.0)
    monkeypatch.setattr(tools, "run_python", missing)
    observation, _, _, _, info = env.step("pprint(1)")
    assert observation.startswith("Tool error: no sandbox here") and counts(info) == (1.0, 1.0, 0.0)


def test_the_python_tool_asks_the_sandbox_for_the_configured_isolation_and_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = {}

    def fake(code: str, *, limits, isolation) -> SandboxResult:
        seen.update(code=code, timeout=limits.timeout_s, isolation=isolation)
        return SandboxResult("7\n", "", 0, False, False, 0.0)

    monkeypatch.setattr(tools, "run_python", fake)
    env = ToolUse(tools=["python"], tool_timeout_s=2.5, sandbox_isolation="unshare")
    env.reset(0)
    observation, _, _, _, _ = env.step("p\n    x = 7\n    print(x)\n")
    assert observation == "=7"
    assert seen == {"code": "x = 7\nprint(x)", "timeout": 2.5, "isolation": "unshare"}


def test_seeds_are_deterministic_questions() -> None:
    env = ToolUse(digits=3)
    assert env.reset(11)[0] == ToolUse(digits=3).reset(11)[0]
    questions = {env.reset(seed)[0] for seed in range(50)}
    assert len(questions) == 50
    assert all(len(q.split("*")[0]) == len(q.split("*")[1]) == 3 for q in questions)


def test_held_out_questions_are_never_trained_on_even_swapped() -> None:
    env = ToolUse(digits=1)  # 81 questions, 45 up to order: training seeds must skip many
    held_out = {env.layout(seed) for seed in held_out_seeds(10)}
    seeds = training_seeds(env, held_out=10)
    trained = [next(seeds) for _ in range(200)]
    assert all(seed >= 10 and env.layout(seed) not in held_out for seed in trained)
    # The skipped seeds include swapped twins of held-out questions: layout() orders the factors.
    twins = [s for s in range(10, max(trained)) if "{1}*{0}".format(*question_for(s, 1)) in held_out]
    assert any(question_for(s, 1)[0] > question_for(s, 1)[1] for s in twins)
    assert not set(twins) & set(trained)


def test_options_are_checked_at_load() -> None:
    assert check_env("env", "tool_use", {"digits": 2, "tools": ["calculator", "python"]}) == []
    for options, words in [
        ({"digits": 0}, "digits"),
        ({"tools": "calculator"}, "tools"),
        ({"tools": ["shell"]}, "tools"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"tool_timeout_s": 0}, "tool_timeout_s"),
        ({"sandbox_isolation": "docker"}, "sandbox_isolation"),
    ]:
        (problem,) = check_env("env", "tool_use", options)
        assert words in problem
    assert "Did you mean 'tools'" in check_env("env", "tool_use", {"tool": ["python"]})[0]


def test_the_expert_always_succeeds_without_noise() -> None:
    env, expert = make_env("tool_use"), make_agent("tool_expert", {"noise": 0.0})
    episodes = [play(env, expert, seed, max_turns=2) for seed in range(100)]
    assert all(e.success for e in episodes)
    assert all(e.actions[0].startswith("c") and e.metrics[0]["tool_calls"] == 1.0 for e in episodes)


def test_the_noisy_expert_guesses_instead_of_calling_and_is_mostly_wrong() -> None:
    env, expert = make_env("tool_use"), make_agent("tool_expert", {"noise": 0.5}, seed=1)
    episodes = [play(env, expert, seed, max_turns=2) for seed in range(400)]
    guessed = [e for e in episodes if e.actions[0].startswith("a")]
    assert 0.4 < len(guessed) / len(episodes) < 0.6
    assert sum(e.success for e in guessed) <= 0.05 * len(guessed)
    assert all(e.success for e in episodes if e.actions[0].startswith("c"))
    # A plausible guess: the factors rounded to their leading digit (37*48 -> 2000).
    env.reset(0)
    a, b = question_for(0, 2)
    assert make_agent("tool_expert", {"noise": 1.0}).act(f"{a}*{b}") == f"a{round(a, -1) * round(b, -1)}"


def test_the_example_recipe_can_spell_every_turn_and_result_of_the_expert() -> None:
    cfg = load_config("examples/agentic_tool.yaml")
    assert cfg.env.name == "tool_use" and cfg.sft_warm_start.expert == "tool_expert"
    alphabet = set(cfg.model.tiny.alphabet)
    env, expert = make_env(cfg.env.name, cfg.env.options), make_agent("tool_expert", {"noise": 0.5})
    for seed in range(50):
        episode = play(env, expert, seed, max_turns=cfg.env.max_turns)
        # The final "Right."/"Wrong." ends the episode: the policy never reads it.
        for text in [*episode.actions, *episode.observations[:-1]]:
            assert set(text) <= alphabet, text
