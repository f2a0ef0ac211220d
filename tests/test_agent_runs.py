"""``agent:``: users' agent programs played through the endpoint by the agent scheduler
(``roll.rollout.agent_scheduler``), against a fake rollout backend, with the real ``openai`` client and
the real server on localhost."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")

import agent_programs  # noqa: E402 - after the skips
from fake_rollout import FakeBackend  # noqa: E402

from roll.envs.seeds import SeedOrder  # noqa: E402
from roll.models.tokenizer import build_char_tokenizer  # noqa: E402
from roll.rollout.agent_runs import AgentRunner, TaskList  # noqa: E402
from roll.rollout.agent_scheduler import AgentScheduler, AgentSpec, SchedulerEngine, demonstrations  # noqa: E402
from roll.rollout.sessions import SessionStore  # noqa: E402
from roll.serving.app import Limits, build_app  # noqa: E402
from roll.serving.server import ServerThread  # noqa: E402
from roll.strategies.requests import SamplingParams  # noqa: E402

TOKENIZER = build_char_tokenizer("0123456789*=? ")
EOS = TOKENIZER.eos_token_id
ANSWER = TOKENIZER.encode("42", add_special_tokens=False) + [EOS]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)


def write_tasks(path, tasks):
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return path


@pytest.fixture()
def served():
    """A factory: ``make(entrypoint, tasks, spec)`` -> (scheduler, backend); everything closed after."""
    opened = []

    def make(entrypoint, tasks, spec, tmp_path, workers=1, reply=ANSWER, concurrency=None):
        backend = FakeBackend(lambda request: (list(reply), 0.0), num_workers=workers, cut_at_max_tokens=True)
        backend.requests = []
        script = backend.script
        backend.script = lambda request: (backend.requests.append(request), script(request))[1]
        sessions, engine = SessionStore(), SchedulerEngine()
        limits = Limits(max_tokens=8, max_model_len=None, clamp_max_tokens=True)
        app = build_app(engine, TOKENIZER, None, [EOS], limits, sessions)
        server = ServerThread(app).start()
        runner = AgentRunner(entrypoint, concurrency=concurrency)
        task_list = TaskList(write_tasks(tmp_path / "tasks.jsonl", tasks), 0)
        scheduler = AgentScheduler(
            backend, runner, sessions, server.base_url, spec, PARAMS, task_list, SeedOrder(task_list, 0), 0
        )
        engine.scheduler = scheduler
        opened.append((scheduler, runner, server))
        return scheduler, backend, sessions

    yield make
    for scheduler, runner, server in opened:
        scheduler.close()
        runner.close()
        server.stop()


TASK = {"question": "6*7=?", "answer": "42"}


@pytest.mark.parametrize("entrypoint", [agent_programs.answer_twice, agent_programs.answer_once])
def test_each_run_trains_exactly_the_ids_the_policy_sampled_in_its_session(
    served, tmp_path, entrypoint, monkeypatch
):
    import ssl

    spec = AgentSpec(groups_per_step=2, group_size=2, timeout_s=60)
    scheduler, backend, sessions = served(
        entrypoint, [TASK, {"question": "7*6=?", "answer": "24"}], spec, tmp_path
    )
    made = []  # TLS contexts made while the runs play: each loads the CA bundle on the agents' loop
    create = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(1) or create(*a, **k))
    batch, metrics = scheduler.next_batch(0)
    assert made == []  # the runs' clients share the runner's
    calls = 2 if entrypoint is agent_programs.answer_twice else 1
    assert len(batch) == 4 and batch["group_index"].tolist() == [0, 0, 1, 1]
    assert batch["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]  # the agents' own rewards
    for row in range(4):
        n = int(batch["response_mask"][row].sum())
        response = batch["response_ids"][row, :n].tolist()
        trained = [t for t, keep in zip(response, batch["loss_mask"][row, :n].tolist()) if keep]
        assert trained == ANSWER * calls  # the sampled ids, and only those
        assert response[: len(ANSWER)] == ANSWER
        if calls == 2:  # the next user turn sits between them, masked
            middle = response[len(ANSWER) : -len(ANSWER)]
            assert TOKENIZER.decode(middle) == "<|user|>1<|assistant|>"
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        assert TOKENIZER.decode(prompt) == f"<|user|>{'6*7=?' if row < 2 else '7*6=?'}<|assistant|>"
    assert metrics["agent/calls"] == calls and metrics["agent/forks"] == 0
    assert metrics["agent/return"] == 0.5 and metrics["rollout/dropped_groups"] == 0
    # The run's sampling, whatever the agent asked (temperature 0.3); fewer tokens may be asked for.
    assert {request.params.temperature for request in backend.requests} == {1.0}
    assert sorted({request.params.max_new_tokens for request in backend.requests}) == (
        [4, 8] if calls == 2 else [8]
    )
    # Each call names its run's session (routing, and the engine's kept KV); ended sessions are closed.
    run_ids = set(batch.non_tensors["episode_id"])
    assert {request.cache_key for request in backend.requests} == run_ids
    assert all(sessions.get(run_id) is None for run_id in run_ids)


def test_agents_that_raise_hang_never_call_or_give_no_reward_are_dropped_and_counted(served, tmp_path):
    agent_programs.ATTEMPTS.clear()
    modes = ["ok", "raise", "hang", "silent", "none", "posted"]
    tasks = [{**TASK, "question": f"{k}*7=?", "mode": mode} for k, mode in enumerate(modes)]
    spec = AgentSpec(groups_per_step=len(tasks), group_size=1, timeout_s=3)
    scheduler, _, _ = served(agent_programs.flaky, tasks, spec, tmp_path)
    batch, metrics = scheduler.next_batch(0)
    # Four groups failed, were dropped and the next tasks drawn in their place (seeds 6-9: tasks 0-3
    # again; the agent behaves on its second run of a task).
    assert metrics["rollout/dropped_groups"] == 4
    assert sorted(batch.non_tensors["seed"]) == [0, 5, 6, 7, 8, 9]
    runs = 10  # six tasks, four of them played twice
    for failure in ("agent_error", "agent_timeout", "no_calls", "no_reward"):
        assert metrics[f"agent/{failure}_frac"] == pytest.approx(1 / runs), failure
    # A failed run is never scored (no zero for it): the runs trained answered right on their second
    # try, and the posted reward is kept.
    scores = dict(zip(batch.non_tensors["seed"], batch["scores"].tolist()))
    assert scores == {0: 1.0, 5: 0.5, 6: 1.0, 7: 1.0, 8: 1.0, 9: 1.0}


def test_64_plain_function_agents_run_at_once_and_none_waits_for_a_thread(served, tmp_path):
    """Each plain function gets a thread of its own as its run starts: 64 runs that can only finish
    together (a barrier of 64) all finish. On asyncio's default pool (min(32, cores + 4) threads) they
    waited for a thread with their clocks running, and timed out."""
    import threading

    agent_programs.MEETING = threading.Barrier(64, timeout=60)  # broken, not hung, if they never meet
    spec = AgentSpec(groups_per_step=16, group_size=4, timeout_s=30)
    tasks = [{**TASK, "question": f"{k}*7=?"} for k in range(16)]
    scheduler, _, _ = served(agent_programs.meet_then_answer, tasks, spec, tmp_path)
    try:
        batch, metrics = scheduler.next_batch(0)
    finally:
        agent_programs.MEETING.abort()
    assert len(batch) == 64 and metrics["agent/failed_frac"] == 0
    assert metrics["rollout/dropped_groups"] == 0 and metrics["agent/agent_timeout_frac"] == 0


def test_agent_concurrency_caps_the_runs_playing_at_once_and_a_waiting_run_starts_its_clock_late(
    served, tmp_path
):
    """agent.concurrency 3: 16 runs of 4 groups play at most three at a time, all kept. A run waiting for
    a slot has not started: held up past its timeout by a slot taken from it, it still ends well once
    the slot is free (its clock starts with it)."""
    import asyncio
    import threading

    agent_programs.PLAYING[:] = [0, 0]
    spec = AgentSpec(groups_per_step=4, group_size=4, timeout_s=30)
    tasks = [{**TASK, "question": f"{k}*7=?"} for k in range(4)]
    scheduler, _, _ = served(agent_programs.count_the_runs_playing, tasks, spec, tmp_path, concurrency=3)
    batch, metrics = scheduler.next_batch(0)
    assert len(batch) == 16 and metrics["agent/failed_frac"] == 0
    assert agent_programs.PLAYING[0] == 0 and 1 <= agent_programs.PLAYING[1] <= 3

    async def returns_at_once(client, task):
        return 1.0

    runner = AgentRunner(returns_at_once, concurrency=1)
    try:
        asyncio.run_coroutine_threadsafe(runner._slots.acquire(), runner._loop).result(timeout=10)
        ended, outcomes = threading.Event(), []
        on_done = lambda outcome: (outcomes.append(outcome), ended.set())  # noqa: E731
        runner.start({}, "http://127.0.0.1:9/v1", 0.2, lambda: None, on_done)
        assert not ended.wait(0.5)  # waiting for the slot, past its timeout: not started, not timed out
        runner._loop.call_soon_threadsafe(runner._slots.release)
        assert ended.wait(10) and outcomes[0].reward == 1.0 and outcomes[0].failure is None
    finally:
        runner.close()


def test_a_hung_run_holds_up_only_itself_in_the_warm_start_and_progress_is_printed(
    served, tmp_path, monkeypatch, caplog
):
    """Demonstrations with one task in ten hanging: spare groups play on, the batches take the groups
    that are done, and the warm start ends without waiting out a single timeout (the hung runs are
    still playing when it ends). Meanwhile a progress line says how many ended and are playing."""
    import itertools
    import logging

    import roll.rollout.agent_scheduler as agent_scheduler

    readings = itertools.count(step=1.0)  # every reading of the progress clock is a second later
    monkeypatch.setattr(agent_scheduler, "clock", lambda: next(readings))
    tasks = [{**TASK, "question": f"{k}*7=?", "hangs": k % 10 == 3} for k in range(20)]
    spec = AgentSpec(groups_per_step=10, group_size=1, timeout_s=300, spare_groups=10)
    scheduler, _, _ = served(agent_programs.hang_where_told, tasks, spec, tmp_path)
    scheduler.progress_every_s = 5.0
    with caplog.at_level(logging.INFO, logger=agent_scheduler.__name__):
        played = demonstrations(scheduler, 40)
    assert len(played.rows) == 40 and all(row["loss_mask"] for row in played.rows)
    hanging = [group for group in scheduler._live if scheduler.tasks.task(group.seed)["hangs"]]
    assert hanging and not any(run.done for group in hanging for run in group.members.values())
    assert scheduler._ended["agent_timeout"] == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("agent runs:")]
    assert lines and "playing" in lines[-1] and "ended" in lines[-1]


def test_asynchronous_steps_are_not_held_up_by_a_hung_run(served, tmp_path):
    """With async_generation_ratio 1 a batch takes the groups that are done: three steps go by while
    the runs of a hanging task are still playing (none waited out its timeout)."""
    tasks = [{**TASK, "question": f"{k}*7=?", "hangs": k == 1} for k in range(10)]
    spec = AgentSpec(groups_per_step=3, group_size=2, timeout_s=300, async_generation_ratio=1)
    scheduler, backend, _ = served(agent_programs.hang_where_told, tasks, spec, tmp_path)
    seeds = []
    for step in range(3):
        batch, metrics = scheduler.next_batch(step)
        seeds += batch.non_tensors["seed"][::2]
        assert metrics["agent/agent_timeout_frac"] == 0
    assert len(seeds) == 9 and all(not scheduler.tasks.task(seed)["hangs"] for seed in seeds)
    with scheduler._lock:
        hanging = [group for group in scheduler._live if scheduler.tasks.task(group.seed)["hangs"]]
        assert hanging and not any(run.done for group in hanging for run in group.members.values())


def test_synchronous_steps_with_spare_groups_are_not_held_up_by_a_hung_run(served, tmp_path):
    """agent.spare_groups 2: each synchronous batch takes the first three groups to finish; the ones it
    passed over are dropped once the weights move (they hold the old weights' tokens) and their tasks
    drawn again, so three steps go by while a hanging task's runs play, none waiting out its timeout."""
    tasks = [{**TASK, "question": f"{k}*7=?", "hangs": k == 1} for k in range(10)]
    spec = AgentSpec(groups_per_step=3, group_size=2, timeout_s=300, spare_groups=2)
    scheduler, backend, _ = served(agent_programs.hang_where_told, tasks, spec, tmp_path)
    stale = 0.0
    for step in range(3):
        batch, metrics = scheduler.next_batch(step)
        assert len(batch) == 6 and metrics["agent/agent_timeout_frac"] == 0
        assert not any(scheduler.tasks.task(seed)["hangs"] for seed in batch.non_tensors["seed"])
        assert set(batch["rollout_logprobs"].nonzero()[:, 0].tolist()) == set(range(6))
        stale += metrics["rollout/stale_groups"]
        backend.version = step + 1  # the workers sample with the new weights, then the scheduler hears
        scheduler.set_weights_version(step + 1)
    assert stale >= 2  # the hanging task's group at least, passed over twice and drawn again
    with scheduler._lock:
        hanging = [group for group in scheduler._live if scheduler.tasks.task(group.seed)["hangs"]]
        assert hanging and all(group.start_version == 2 for group in hanging)  # drawn again each step
        assert not any(run.done for group in hanging for run in group.members.values())


def test_a_spare_run_takes_the_place_of_a_failed_one_in_its_group(served, tmp_path):
    agent_programs.ATTEMPTS.clear()
    spec = AgentSpec(groups_per_step=1, group_size=2, timeout_s=60, redundancy=1)
    task = {**TASK, "mode": "raise"}  # the first of its three runs to start raises, the others answer
    scheduler, _, _ = served(agent_programs.flaky, [task], spec, tmp_path)
    batch, metrics = scheduler.next_batch(0)
    assert metrics["rollout/dropped_groups"] == 0 and batch["scores"].tolist() == [1.0, 1.0]
    assert agent_programs.ATTEMPTS[TASK["question"]] == 3


def test_a_registered_reward_scores_the_last_reply_of_an_agent_that_returns_none(served, tmp_path):
    from roll.rewards.base import score_response

    seen = []

    def exact_match(prompt_ids, reply_ids, task):
        seen.append((TOKENIZER.decode(prompt_ids), TOKENIZER.decode(reply_ids, skip_special_tokens=True)))
        return score_response("exact_match", seen[-1][0], seen[-1][1], task, reply_ids).score

    spec = AgentSpec(groups_per_step=2, group_size=1, timeout_s=60)
    tasks = [TASK, {"question": "7*6=?", "answer": "24"}]
    scheduler, _, _ = served(agent_programs.answer_and_leave_the_scoring, tasks, spec, tmp_path)
    scheduler.transcript_reward = exact_match
    batch, metrics = scheduler.next_batch(0)
    assert batch["scores"].tolist() == [1.0, 0.0] and metrics["agent/no_reward_frac"] == 0
    # The reply scored is the run's last; the prompt is everything before it, as rendered.
    assert sorted(seen) == [
        ("<|user|>6*7=?<|assistant|>42<|eos|><|user|>1<|assistant|>", "42"),
        ("<|user|>7*6=?<|assistant|>42<|eos|><|user|>1<|assistant|>", "42"),
    ]


def test_asynchronous_runs_play_ahead_and_stay_within_the_staleness_bound(served, tmp_path):
    spec = AgentSpec(groups_per_step=2, group_size=2, timeout_s=60, async_generation_ratio=1)
    tasks = [{**TASK, "question": f"{k}*7=?"} for k in range(8)]
    scheduler, backend, _ = served(agent_programs.answer_twice, tasks, spec, tmp_path)
    scheduler.next_batch(0)
    # The next batch plays while "the actor trains" (a liveness bound, not a timing assumption).
    with scheduler._changed:
        assert scheduler._changed.wait_for(lambda: scheduler.batch_ready, timeout=60)
    # Two weights versions on: what was played ahead on version 0 is stale and played again.
    backend.version = 2
    scheduler.set_weights_version(2)
    _, metrics = scheduler.next_batch(1)
    assert metrics["rollout/stale_groups"] >= 2 and metrics["rollout/staleness_max"] <= 1
    assert metrics["agent/failed_frac"] == 0


@pytest.mark.parametrize(
    ("entrypoint", "reward"), [(agent_programs.call_until_cut_off, 0.25), (agent_programs.never_stops, 0.0)]
)
def test_a_run_past_its_turn_budget_is_trained_with_its_stop_reason(served, tmp_path, entrypoint, reward):
    """The call past env.max_turns gets a reply at the length limit, not an error: the run ends with
    stop reason max_turns and trains as env.stop_reasons says. An agent that calls on regardless (a plain
    function here) is ended at its next call, and scores 0."""
    spec = AgentSpec(groups_per_step=2, group_size=1, timeout_s=60, max_calls=2)
    scheduler, backend, _ = served(entrypoint, [TASK, {**TASK, "question": "7*6=?"}], spec, tmp_path)
    batch, metrics = scheduler.next_batch(0)
    assert batch.non_tensors["stop_reason"] == ["max_turns", "max_turns"]
    assert batch["scores"].tolist() == [reward, reward]
    assert metrics["agent/stop/max_turns"] == 1 and metrics["agent/failed_frac"] == 0
    assert metrics["rollout/dropped_groups"] == 0 and len(backend.requests) == 4  # two calls a run
    for row in range(2):
        n = int(batch["response_mask"][row].sum())
        trained = batch["response_ids"][row, :n][batch["loss_mask"][row, :n].bool()].tolist()
        assert trained == ANSWER * 2  # the sampled ids of both calls; the refused one added nothing

    masked = dataclasses.replace(spec, stop_policy={"max_turns": "mask"})
    scheduler, _, _ = served(entrypoint, [TASK], dataclasses.replace(masked, groups_per_step=1), tmp_path)
    batch, _ = scheduler.next_batch(0)
    assert batch["loss_mask"].sum() == 0 and batch["response_mask"].sum() > 0


def test_an_agent_that_fails_on_a_reply_cut_at_its_length_limit_is_trained_as_turn_truncated(
    served, tmp_path
):
    """As the OpenAI Agents SDK raises on an incomplete response: the policy's reply ran past
    rollout.max_new_tokens, so the run is scored 0 with stop reason turn_truncated (trained, or masked as
    env.stop_reasons says), not dropped as the agent's failure."""
    babble = TOKENIZER.encode("1111111111111", add_special_tokens=False)  # past the 8 tokens a reply gets
    spec = AgentSpec(groups_per_step=1, group_size=2, timeout_s=60)
    entrypoint = agent_programs.raise_on_a_cut_reply
    scheduler, _, _ = served(entrypoint, [TASK], spec, tmp_path, reply=babble)
    batch, metrics = scheduler.next_batch(0)
    assert batch.non_tensors["stop_reason"] == ["turn_truncated"] * 2 and batch["scores"].tolist() == [0, 0]
    assert metrics["agent/stop/turn_truncated"] == 1 and metrics["agent/agent_error_frac"] == 0
    assert batch["loss_mask"].sum(dim=1).tolist() == [8, 8]  # the cut reply's sampled ids
    masked = dataclasses.replace(spec, stop_policy={"turn_truncated": "mask"})
    scheduler, _, _ = served(entrypoint, [TASK], masked, tmp_path, reply=babble)
    batch, _ = scheduler.next_batch(0)
    assert batch["loss_mask"].sum() == 0
    scheduler, _, _ = served(entrypoint, [TASK], spec, tmp_path)  # a reply that ends: the agent's reward
    batch, metrics = scheduler.next_batch(0)
    assert batch["scores"].tolist() == [1, 1] and batch.non_tensors["stop_reason"] == ["agent_done"] * 2


def test_an_async_agent_that_blocks_the_event_loop_is_measured_and_named(served, tmp_path, caplog):
    """Two runs that each block the loop for 0.6 s (it cannot be less, however busy the machine):
    ``agent/loop_blocked_s`` counts at least a second, and a warning names the agent."""
    import logging

    spec = AgentSpec(groups_per_step=1, group_size=2, timeout_s=60)
    scheduler, _, _ = served(agent_programs.blocks_the_loop, [TASK], spec, tmp_path)
    with caplog.at_level(logging.WARNING, logger="roll.rollout.agent_runs"):
        batch, metrics = scheduler.next_batch(0)
    assert batch["scores"].tolist() == [1, 1] and metrics["agent/loop_blocked_s"] >= 1.0
    assert "the async agent agent_programs:blocks_the_loop runs blocking code" in caplog.text


def test_a_call_past_the_context_budget_ends_the_run_with_context_limit(served, tmp_path):
    """env.max_context_tokens bounds each call: a reply gets at most the room left, and the call with no
    room gets the length-limit reply; the row the run trains stays within the budget."""
    prompt = len(TOKENIZER.encode("<|user|>6*7=?<|assistant|>", add_special_tokens=False))
    limit = prompt + len(ANSWER) + 2  # the second call's prompt has no room left
    spec = AgentSpec(groups_per_step=1, group_size=1, timeout_s=60, max_context_tokens=limit)
    scheduler, backend, _ = served(agent_programs.call_until_cut_off, [TASK], spec, tmp_path)
    batch, metrics = scheduler.next_batch(0)
    assert batch.non_tensors["stop_reason"] == ["context_limit"] and batch["scores"].tolist() == [0.25]
    assert metrics["agent/stop/context_limit"] == 1 and len(backend.requests) == 1
    assert backend.requests[0].params.max_new_tokens == limit - prompt
    assert int(batch["prompt_mask"].sum() + batch["response_mask"].sum()) <= limit


def test_a_call_outside_a_session_is_refused(served, tmp_path):
    import openai

    spec = AgentSpec(groups_per_step=1, group_size=1, timeout_s=60)
    scheduler, _, _ = served(agent_programs.answer_twice, [TASK], spec, tmp_path)
    with pytest.raises(openai.BadRequestError, match="session base URL"):
        client = openai.OpenAI(base_url=f"{scheduler.base_url}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "1"}])


def test_train_branches_all_gives_a_row_per_branch_with_its_runs_reward_and_a_baseline_over_runs(
    served, tmp_path
):
    from roll.config.rlvr import AlgorithmConfig
    from roll.pipelines import credit

    task = {"question": "5*5=?", "answer": "25"}
    spec = AgentSpec(groups_per_step=1, group_size=4, timeout_s=60, train_branches="all", divisor=4)
    scheduler, _, _ = served(agent_programs.with_a_sub_agent, [task], spec, tmp_path)
    batch, metrics = scheduler.next_batch(0)
    real = ~batch["padding"]
    assert len(batch) == 8 and int(real.sum()) == 6  # two runs of two branches, two of one; padded to 4s
    rows: dict[int, list[int]] = {}
    for row in real.nonzero().squeeze(-1).tolist():
        rows.setdefault(int(batch["episode_index"][row]), []).append(row)
    assert sorted(len(r) for r in rows.values()) == [1, 1, 2, 2]
    for run_rows in rows.values():
        assert len({batch.non_tensors["episode_id"][r] for r in run_rows}) == 1
        assert {float(batch["scores"][r]) for r in run_rows} == {float(len(run_rows) == 2)}  # its reward
        prompts = {TOKENIZER.decode(batch["prompt_ids"][r][batch["prompt_mask"][r].bool()]) for r in run_rows}
        assert prompts == ({"<|user|>9*9=?<|assistant|>"} if len(run_rows) == 2 else set()) | {
            "<|user|>5*5=?<|assistant|>"
        }
    assert metrics["agent/untrained_branches"] == 0 and metrics["agent/rows_per_run"] == 1.5
    # GRPO over the four runs, not the six rows: mean 0.5, std 0.5774, so +-0.866; padding rows get 0.
    mask = batch["loss_mask"].float()
    rewards = credit.outcome_token_rewards(batch["scores"], mask)
    per_run = {key: batch[key] for key in credit.PER_TURN_FIELDS if key in batch}
    algo, groups = AlgorithmConfig(), batch["group_index"]
    advantages, _ = credit.compute_advantages(algo, rewards, mask, groups, None, per_run)
    first = advantages[:, 0]
    expected = torch.where(batch["scores"] > 0, 0.8660, -0.8660) * real
    torch.testing.assert_close(first, expected, atol=1e-3, rtol=0)

    longest = dataclasses.replace(spec, train_branches="longest", divisor=1)
    scheduler, _, _ = served(agent_programs.with_a_sub_agent, [task], longest, tmp_path)
    batch, metrics = scheduler.next_batch(0)
    assert len(batch) == 4 and "episode_index" not in batch and metrics["agent/untrained_branches"] == 0.5


@pytest.mark.usefixtures("at_repo_root")
def test_the_agent_section_is_checked_naming_the_key_and_the_old_env_form_loads_with_a_warning(tmp_path):
    from omegaconf import OmegaConf

    from roll.config.loader import ConfigError, load_config

    example = "examples/agent_calculator.yaml"
    tasks = write_tasks(tmp_path / "tasks.jsonl", [TASK, TASK])
    bad = [f"agent.tasks={tasks}", "eval.seeds=2", "agent.entrypoint=agent_programs:nope"]
    bad += ["agent.reward=exact_mach", "env.world_size=2", "env.step_timeout_s=5"]
    bad += ["env.sample_layout=step_wise"]
    with pytest.raises(ConfigError) as error:
        load_config(example, bad)
    problems = str(error.value)
    assert "agent.entrypoint: entrypoint 'agent_programs:nope': agent_programs has no function" in problems
    assert "agent.tasks:" in problems and "holds 2 tasks; eval.seeds (2)" in problems
    assert "agent.reward:" in problems and "exact_match" in problems  # did you mean
    for key in ("world_size", "step_timeout_s", "sample_layout"):
        assert f"env.{key}: not read for agent programs (agent:)" in problems
    with pytest.raises(ConfigError, match="agent.timeout"):
        load_config(example, ["agent.timeout=3"])
    branches = ["agent.train_branches=all", "algorithm.advantage_estimator=reinforce_plus_plus"]
    with pytest.raises(ConfigError, match="all trains several rows per run, and reinforce_plus_plus "):
        load_config(example, branches)
    (tmp_path / "no_entrypoint.yaml").write_text(f"pipeline: agentic\nagent: {{tasks: {tasks}}}\n")
    with pytest.raises(ConfigError, match="`agent.entrypoint` is required"):
        load_config(tmp_path / "no_entrypoint.yaml")

    old = OmegaConf.load(example)  # the form before the agent: section
    old.env.name, old.env.options = "agent", old.pop("agent")
    OmegaConf.save(old, tmp_path / "old.yaml")
    with pytest.warns(FutureWarning, match="env.name: agent with the program in env.options is deprecated"):
        migrated = load_config(tmp_path / "old.yaml")
    assert migrated == load_config(example)
    assert (migrated.agent.entrypoint, migrated.agent.timeout_s) == ("examples/agents/calculator.py:run", 120)


@pytest.mark.usefixtures("at_repo_root")
def test_the_run_budgets_and_stop_reasons_reach_the_agent_scheduler():
    from types import SimpleNamespace

    from roll.config.loader import load_config
    from roll.pipelines.agent_programs import AgentProgramPipeline

    overrides = ["env.max_turns=3", "env.max_context_tokens=150", "env.stop_reasons={max_turns: mask}"]
    cfg = load_config("examples/agent_calculator.yaml", overrides)
    spec = AgentProgramPipeline.agent_spec.fget(SimpleNamespace(config=cfg, agent=cfg.agent))
    assert (spec.max_calls, spec.max_context_tokens) == (3, 150)
    assert spec.stop_policy["max_turns"] == "mask" and spec.stop_policy["context_limit"] == "train"
    cfg = load_config("examples/agent_calculator.yaml", ["env.stop_reasons={turn_truncated: mask}"])
    assert (
        AgentProgramPipeline.agent_spec.fget(SimpleNamespace(config=cfg, agent=cfg.agent)).stop_policy[
            "turn_truncated"
        ]
        == "mask"
    )


QUICK = [
    "steps=3",
    "sft_warm_start=null",
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64",
    "rollout.rollout_batch_size=2",
    "rollout.num_return_sequences=2",
    "eval.seeds=4",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "tracking.backends=[jsonl]",
]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_roll_train_runs_the_agent_program_and_replaces_a_killed_rollout_worker(
    tmp_path, repo_root, monkeypatch, caplog
):
    """``examples/agent_calculator.yaml`` (no warm start, a smaller model) through the pipeline: the agent's
    runs train (every branch a row, in two mini-batches: the batch of varying rows), and the rollout worker
    behind the endpoint, killed before step 2, is replaced without losing a step."""
    import logging
    import os
    import signal

    from roll.config.loader import load_config
    from roll.pipelines.agent_programs import AgentProgramPipeline

    monkeypatch.chdir(repo_root)
    out = tmp_path / "run"
    pipeline = AgentProgramPipeline(
        load_config(
            "examples/agent_calculator.yaml",
            [*QUICK, f"output_dir={out}", "agent.train_branches=all", "actor.mini_batch_size=2"],
        )
    )
    assert pipeline.plan.actor.mini_batches_per_epoch == 2
    killed = pipeline.role_set.live["rollout"]
    step = pipeline.step

    def kill_before(number: int) -> dict[str, float]:
        if number == 2:
            os.kill(killed.ping()[0]["pid"], signal.SIGKILL)
        return step(number)

    pipeline.step = kill_before
    try:
        with caplog.at_level(logging.WARNING):
            pipeline._train()
        assert pipeline.role_set.live["rollout"] is not killed and pipeline.budget.restarts == 1
        assert "replaced the rollout workers" in caplog.text
    finally:
        pipeline.shutdown()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["agent/failed_frac"] == 0 and row["agent/calls"] >= 1, row
        assert row["agent/agent_error_frac"] == 0 and "actor/loss" in row
        assert row["agent/rows_per_run"] == 1 and row["agent/untrained_branches"] == 0  # one context each


@pytest.mark.parametrize("example", ["agent_calculator", "agent_calculator_sdk"])
def test_the_calculator_agent_against_the_expert_records_its_tool_call_and_answer(
    tmp_path, repo_root, example
):
    """The example's agent (plain openai, API tool calls; or the Agents SDK over the Responses API) against
    the warm start's expert: each run's row holds the expert's call and answer as trained ids, the tool's
    result between them masked."""
    if example.endswith("sdk"):
        pytest.importorskip("agents")
    from transformers import AutoTokenizer

    from roll.config.loader import load_config
    from roll.envs.agents import make_agent
    from roll.models.tokenizer import build_char_tokenizer
    from roll.rollout.agent_runs import load_entrypoint
    from roll.rollout.expert_backend import ExpertBackend

    cfg = load_config(repo_root / f"examples/{example}.yaml")
    tokenizer = build_char_tokenizer(cfg.model.tiny.alphabet)
    eos = tokenizer.eos_token_id
    agent = load_entrypoint(str(repo_root / cfg.agent.entrypoint))
    tasks = [{"question": "37*48", "answer": 1776}, {"question": "12*11", "answer": 132}]
    sessions, engine = SessionStore(), SchedulerEngine()
    app = build_app(engine, tokenizer, None, [eos], Limits(max_tokens=72, max_model_len=192), sessions)
    expert = make_agent("tool_call_expert", {"noise": 0.0})
    task_list = TaskList(write_tasks(tmp_path / "tasks.jsonl", tasks), 0)
    spec = AgentSpec(groups_per_step=2, group_size=1, timeout_s=60, max_calls=2)
    with ServerThread(app) as server:
        runner = AgentRunner(agent)
        scheduler = AgentScheduler(
            ExpertBackend(expert, tokenizer, eos),
            runner,
            sessions,
            server.base_url,
            spec,
            SamplingParams(max_new_tokens=72),
            task_list,
            SeedOrder(task_list, 0),
            tokenizer.pad_token_id,
        )
        engine.scheduler = scheduler
        try:
            batch, metrics = scheduler.next_batch(0)
            played = demonstrations(scheduler, 2)  # the warm start's rows: the same tasks again
        finally:
            scheduler.close()
            runner.close()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    plain = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert batch["scores"].tolist() == [1.0, 1.0] and metrics["agent/calls"] == 2
    assert metrics["agent/forks"] == 0  # the tool result continued the branch: nothing re-rendered
    for row, task in enumerate(tasks):
        n = int(batch["response_mask"][row].sum())
        ids, trained = batch["response_ids"][row, :n].tolist(), batch["loss_mask"][row, :n].tolist()
        assert played.rows[row] == {"response_ids": ids, "loss_mask": trained}
        arguments = json.dumps({"name": "calc", "arguments": {"x": task["question"]}}, separators=(",", ":"))
        call = f"<tool_call>{arguments}</tool_call>"
        sampled = [t for t, keep in zip(ids, trained) if keep]
        assert sampled == tokenizer.encode(call) + [eos] + tokenizer.encode(str(task["answer"])) + [eos]
        masked = tokenizer.decode([t for t, keep in zip(ids, trained) if not keep])
        assert masked == f"<|user|><tool_response>{task['answer']}</tool_response><|assistant|>"
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        assert played.token_ids[row] == prompt
        assert (
            tokenizer.decode(prompt)
            == f"<|system|><tools>calc</tools><|user|>{task['question']}<|assistant|>"
        )
        # The same conversation rendered by the saved tokenizer, loaded with plain transformers: the ids
        # training recorded are the ones a user's template gives (no drift between them).
        tool_call = {"type": "function", "function": {"name": "calc", "arguments": {"x": task["question"]}}}
        conversation = [
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "content": str(task["answer"])},
            {"role": "assistant", "content": str(task["answer"])},
        ]
        tools = load_entrypoint(str(repo_root / "examples/agents/calculator.py:run")).__globals__["TOOLS"]
        text = plain.apply_chat_template(conversation, tools=tools, tokenize=False)
        assert plain.encode(text, add_special_tokens=False) == prompt + ids
