"""Agent programs for the tests of agent programs (``agent:``): plain ``openai`` clients, no ROLL imports.

``answer_twice`` asks for the answer, then asks again with the reply in its history; ``flaky`` fails once
per task in the way the task's ``mode`` names, then behaves: a failing task's group is dropped and its
task drawn again, so a test sees both the drop and the batch.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import httpx

ATTEMPTS: collections.Counter[str] = collections.Counter()  # task name -> runs started
_LOCK = threading.Lock()


async def answer_twice(client, task: dict) -> float:
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="any", messages=messages, temperature=0.3)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "1"}]
    second = await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    return float(second.choices[0].message.content == task["answer"])


def answer_once(client, task: dict) -> float:
    """The same as a plain function with the synchronous client."""
    # More tokens than the run gives: it gets the run's budget (rollout.max_new_tokens), not a 400.
    messages = [{"role": "user", "content": task["question"]}]
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=4096)
    return float(reply.choices[0].message.content == task["answer"])


async def flaky(client, task: dict) -> float | None:
    with _LOCK:
        ATTEMPTS[task["question"]] += 1
        first_try = ATTEMPTS[task["question"]] == 1
    mode = task["mode"] if first_try else "ok"
    if mode == "silent":  # never calls the policy
        return 1.0
    if mode == "hang":
        await asyncio.Event().wait()
    reply = await client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": task["question"]}]
    )
    if mode == "raise":
        raise RuntimeError("the agent's own bug")
    if mode == "none":  # returns no reward and posts none
        return None
    if mode == "posted":  # posts its reward for its session and returns None
        session = str(client.base_url).rstrip("/").split("/")[-2]
        root = str(client.base_url).split("/sessions/")[0]
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{root}/rl/sessions/{session}/reward", json={"reward": 0.5})
            answer.raise_for_status()
        return None
    return float(reply.choices[0].message.content == task["answer"])


async def answer_and_leave_the_scoring(client, task: dict) -> None:
    """Asks twice and returns no reward: ``agent.reward`` scores its transcript."""
    await answer_twice(client, task)


async def call_until_cut_off(client, task: dict) -> float:
    """Calls on, as a looping agent does, until a reply comes back at the length limit (its budget was
    spent): then it gives up with what it has."""
    messages = [{"role": "user", "content": task["question"]}]
    while True:
        reply = await client.chat.completions.create(model="any", messages=messages)
        choice = reply.choices[0]
        if choice.finish_reason == "length":
            assert choice.message.content == ""  # nothing was sampled
            return 0.25
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "1"}]


def never_stops(client, task: dict) -> float:
    """A plain function that ignores the length limit and calls on for ever."""
    messages = [{"role": "user", "content": task["question"]}]
    while True:
        reply = client.chat.completions.create(model="any", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "1"}]


MEETING: threading.Barrier | None = None  # set by the test: how many runs must be in flight at once


def meet_then_answer(client, task: dict) -> float:
    """A plain function that answers only once every run of its barrier is running at the same time
    (a thread pool smaller than the runs in flight never gets them all there)."""
    assert MEETING is not None
    MEETING.wait()
    return answer_once(client, task)


async def hang_where_told(client, task: dict) -> float:
    """Hangs for ever on a task marked ``hangs`` (past any test's patience, short of its timeout);
    answers the others."""
    if task.get("hangs"):
        await asyncio.Event().wait()
    return await answer_twice(client, task)


PLAYING = [0, 0]  # runs of count_the_runs_playing playing now, and the most at once


async def count_the_runs_playing(client, task: dict) -> float:
    """Answers twice, counting the runs playing meanwhile (``PLAYING``)."""
    with _LOCK:
        PLAYING[0] += 1
        PLAYING[1] = max(PLAYING)
    try:
        return await answer_twice(client, task)
    finally:
        with _LOCK:
            PLAYING[0] -= 1


async def with_a_sub_agent(client, task: dict) -> float:
    """Every other run of a task first asks a sub-agent (a context of its own in the run's session) and
    scores 1; the others answer at once and score 0."""
    with _LOCK:
        ATTEMPTS[f"sub-agent {task['question']}"] += 1
        delegate = ATTEMPTS[f"sub-agent {task['question']}"] % 2 == 1
    if delegate:
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "9*9=?"}])
    question = [{"role": "user", "content": task["question"]}]
    await client.chat.completions.create(model="any", messages=question)
    return float(delegate)


async def raise_on_a_cut_reply(client, task: dict) -> float:
    """Raises on a reply cut at its length limit, as the OpenAI Agents SDK does on an incomplete response."""
    reply = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "1"}])
    if reply.choices[0].finish_reason == "length":
        raise RuntimeError("the reply was cut at its length limit")
    return 1.0


async def blocks_the_loop(client, task: dict) -> float:
    """An async agent with blocking code in it (a sleep standing in for a synchronous client)."""
    time.sleep(0.6)
    reply = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "1"}])
    return float(reply.choices[0].finish_reason == "stop")
