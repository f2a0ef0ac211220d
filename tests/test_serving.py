"""The OpenAI-compatible endpoint (``roll.serving``), through the real ``openai`` client library against the
real server on localhost: a tiny model behind ROLL's engine, and a scripted engine where the test must
choose what the policy "samples" (merge-prone ids, tool calls)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from scripted_server import TOOL_REPLY, ScriptedEngine, tool_tokenizer  # noqa: E402

from roll.config.common import TinyModelConfig  # noqa: E402 - after the skips
from roll.models.loading import end_of_sequence_ids, load_causal_lm, load_tokenizer  # noqa: E402
from roll.models.tiny import save_tiny_model  # noqa: E402
from roll.models.tokenizer import IM_END  # noqa: E402
from roll.rollout.sessions import SessionStore  # noqa: E402
from roll.serving.app import Limits, build_app  # noqa: E402
from roll.serving.server import ServerThread  # noqa: E402
from roll.strategies.infer.hf import HFEngine  # noqa: E402
from roll.strategies.requests import GenerateResult  # noqa: E402

TINY = TinyModelConfig(
    alphabet="0123456789+= ",
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def bpe():
    return tool_tokenizer()


@pytest.fixture()
def scripted(bpe):
    """A server over a ScriptedEngine: (engine, sessions, server); fill ``engine.replies`` first."""
    engine = ScriptedEngine([])
    sessions = SessionStore()
    app = build_app(
        engine, bpe, "agent", [bpe.convert_tokens_to_ids(IM_END)], Limits(max_request_bytes=4096), sessions
    )
    with ServerThread(app) as server:
        yield engine, sessions, server


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A tiny random model behind ROLL's HFEngine; the engine's every result is kept (``engine.results``)."""
    path = save_tiny_model(TINY, tmp_path_factory.mktemp("serving") / "tiny")
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    engine = HFEngine(model, tokenizer, "cpu")
    engine.results = []
    await_result = engine.await_result

    def kept(request_id, timeout_s):
        result = await_result(request_id, timeout_s)
        engine.results.append(result)
        return result

    engine.await_result = kept
    sessions = SessionStore()
    eos = end_of_sequence_ids(tokenizer, model)
    app = build_app(engine, tokenizer, "tiny", eos, Limits(max_model_len=128, max_tokens=8), sessions)
    with ServerThread(app) as server:
        yield engine, sessions, server, tokenizer
    engine.shutdown()


def client_for(server: ServerThread, session: str | None = None, **kwargs) -> openai.OpenAI:
    path = f"/sessions/{session}/v1" if session else "/v1"
    return openai.OpenAI(base_url=server.base_url + path, api_key="unused", max_retries=0, **kwargs)


def test_an_openai_client_gets_chat_completions_and_completions_from_the_model(tiny_server) -> None:
    engine, _, server, tokenizer = tiny_server
    client = client_for(server)
    assert [model.id for model in client.models.list()] == ["tiny"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "12+3="}], max_tokens=5, temperature=0.7
    )
    (choice,) = chat.choices
    sampled = engine.results[-1].token_ids
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(sampled, skip_special_tokens=True)
    assert choice.finish_reason == engine.results[-1].finish_reason
    assert chat.usage.completion_tokens == len(sampled)
    completion = client.completions.create(model="tiny", prompt="1+1=", max_tokens=4, n=2)
    assert len(completion.choices) == 2 and completion.usage.prompt_tokens == 4
    greedy = [
        client.completions.create(model="tiny", prompt="7+", max_tokens=6, temperature=0) for _ in range(2)
    ]
    assert greedy[0].choices[0].text == greedy[1].choices[0].text  # temperature 0 is greedy


def test_concurrent_sessions_stay_apart_and_record_exactly_what_the_engine_sampled(tiny_server) -> None:
    """Eight agents at once, two turns each, on one server: each session holds one branch with its own
    prompt, and its trained tokens are exactly the ids the engine sampled for its calls."""
    engine, sessions, server, tokenizer = tiny_server
    opened = [httpx.post(server.base_url + "/rl/sessions").json() for _ in range(8)]

    async def agent(session: dict, index: int) -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.base_url + session["base_url"], api_key="-", max_retries=0
        )
        messages = [{"role": "user", "content": f"{index}+{index}="}]
        first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "= "},
        ]
        second = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
        await client.close()
        return [first.id, second.id]

    async def all_agents() -> None:
        await asyncio.gather(*(agent(session, i) for i, session in enumerate(opened)))

    asyncio.run(all_agents())
    sampled = {tuple(result.token_ids) for result in engine.results}
    for index, info in enumerate(opened):
        session = sessions.get(info["id"])
        assert session.stats()["calls"] == 2 and session.stats()["forks"] == 0
        (branch,) = session.branches
        first_prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{index}+{index}="}], add_generation_prompt=True, tokenize=False
        )
        assert tokenizer.decode(branch.token_ids).startswith(first_prompt)
        runs, run = [], []
        for token, trained in zip(branch.token_ids, branch.trained):
            if trained:
                run.append(token)
            elif run:
                runs, run = [*runs, tuple(run)], []
        runs += [tuple(run)] if run else []
        assert len(runs) == 2 and set(runs) <= sampled  # each call's sampled ids, nothing else trained


def test_a_continued_conversation_keeps_the_sampled_ids_and_an_edited_one_forks(scripted, bpe) -> None:
    """The policy sampled "R", "R" as two tokens, which this BPE tokenizer merges into one "RR" when the
    text is encoded again. Continuing the conversation keeps the two sampled ids (trained); editing the
    history forks a branch where the re-rendered tokens are masked and only the new sample is trained."""
    engine, sessions, server = scripted
    r, rr = bpe.convert_tokens_to_ids("R"), bpe.convert_tokens_to_ids("RR")
    end = bpe.convert_tokens_to_ids(IM_END)
    assert bpe.encode("RR") == [rr]  # merge-prone: the sampled ids would not come back
    engine.replies = [[r, r, end], [r, end], [r, r, r, end]]
    session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
    client = client_for(server, session)
    history = [{"role": "user", "content": "go"}]
    first = client.chat.completions.create(model="agent", messages=history)
    assert first.choices[0].message.content == "RR"
    history += [{"role": "assistant", "content": "RR"}, {"role": "user", "content": "again"}]
    client.chat.completions.create(model="agent", messages=history)
    # The second prompt is the first prompt, the sampled ids, and the template's delta: token for token.
    first_prompt, second_prompt = (request.prompt_ids for request in engine.requests)
    assert second_prompt[: len(first_prompt) + 3] == (*first_prompt, r, r, end)
    assert bpe.encode(bpe.decode(list(second_prompt))) != list(second_prompt)  # what re-encoding would train
    (branch,) = sessions.get(session).branches
    assert [t for t, trained in zip(branch.token_ids, branch.trained) if trained] == [r, r, end, r, end]
    assert set(branch.weight_versions[i] for i, trained in enumerate(branch.trained) if trained) == {3}

    edited = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "DD"},
        {"role": "user", "content": "again"},
    ]
    client.chat.completions.create(model="agent", messages=edited)
    recorded = sessions.get(session)
    assert recorded.stats()["forks"] == 1 and len(recorded.branches) == 2
    fork = recorded.branches[1]
    assert [t for t, trained in zip(fork.token_ids, fork.trained) if trained] == [r, r, r, end]
    shared = len(first_prompt)  # the fork keeps what it shares with the first branch, as recorded there
    assert fork.token_ids[:shared] == list(first_prompt) and not any(fork.trained[:shared])
    assert bpe.decode(fork.token_ids[shared:]).startswith("DD")  # the edit: rendered, never trained


def test_a_tool_call_round_trips_through_the_api_and_the_episode_continues(scripted, bpe) -> None:
    engine, sessions, server = scripted
    end = bpe.convert_tokens_to_ids(IM_END)
    engine.replies = [[*bpe.encode(TOOL_REPLY), end], [*bpe.encode("the result is 42"), end]]
    session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
    client = client_for(server, session)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "6*7?"}]
    first = client.chat.completions.create(model="agent", messages=messages, tools=tools)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content == ""
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "6*7"}
    assert "Tools:" in bpe.decode(list(engine.requests[0].prompt_ids))  # the template saw the tools
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    second = client.chat.completions.create(model="agent", messages=messages, tools=tools)
    assert (
        second.choices[0].message.content == "the result is 42" and not second.choices[0].message.tool_calls
    )
    recorded = sessions.get(session)
    assert recorded.stats()["forks"] == 0 and len(recorded.branches) == 1
    second_prompt = bpe.decode(list(engine.requests[1].prompt_ids))
    assert second_prompt.endswith("<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_responses_api_calls_a_tool_and_its_output_continues_the_same_branch(scripted, bpe) -> None:
    """``client.responses.create``: instructions, a function tool, then the call and its output as the
    next input. The second call extends the branch the first recorded (no fork), what trains is exactly
    what was sampled, and what the server cannot honour is refused naming the field."""
    engine, sessions, server = scripted
    end = bpe.convert_tokens_to_ids(IM_END)
    engine.replies = [[*bpe.encode(TOOL_REPLY), end], [*bpe.encode("the result is 42"), end]]
    session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
    client = client_for(server, session)
    tools = [{"type": "function", "name": "calc", "parameters": {"type": "object"}, "strict": False}]
    items: list = [{"role": "user", "content": "6*7?"}]
    first = client.responses.create(model="agent", instructions="Be brief.", input=items, tools=tools)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calc" and first.status == "completed"
    assert json.loads(call.arguments) == {"expression": "6*7"} and first.output_text == ""
    prompt = bpe.decode(list(engine.requests[0].prompt_ids))
    assert "Tools:" in prompt and "<|im_start|>system\nBe brief.<|im_end|>" in prompt
    assert first.usage.output_tokens == len(engine.replies_given[0])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
    items += [call.model_dump(exclude_none=True), output]
    second = client.responses.create(model="agent", instructions="Be brief.", input=items, tools=tools)
    assert second.output_text == "the result is 42" and [item.type for item in second.output] == ["message"]
    (branch,) = sessions.get(session).branches
    assert sessions.get(session).stats()["forks"] == 0
    assert [t for t, kept in zip(branch.token_ids, branch.trained) if kept] == [
        *engine.replies_given[0],
        *engine.replies_given[1],
    ]
    after = "<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert bpe.decode(list(engine.requests[1].prompt_ids)).endswith(after)
    url = f"{server.base_url}/sessions/{session}/v1/responses"
    for extra, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"stream": True}, "stream"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]:
        reply = httpx.post(url, json={"model": "agent", "input": "6*7?", **extra})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (extra, reply.text)


def test_llama_3_1_json_tool_calls_round_trip_and_a_named_call_starts_as_its_template_writes_it() -> None:
    """A template that writes calls as Llama 3.1's does (the reply is ``{"name", "parameters"}``, results in
    an ipython turn): the reply's call is parsed, the tool's result continues the same branch, a forced
    call starts with ``{"name": "calc", "parameters": `` in the prompt (masked), and an answer stays text."""
    from scripted_server import EOT, llama_tool_tokenizer

    llama = llama_tool_tokenizer()
    end = llama.convert_tokens_to_ids(EOT)
    engine, sessions = ScriptedEngine([]), SessionStore()
    call = '{"name": "calc", "parameters": {"expression": "6*7"}}'
    engine.replies = [[*llama.encode(call), end], [*llama.encode("the result is 42"), end]]
    engine.replies.append([*llama.encode('{"expression": "7*6"}}'), end])
    app = build_app(engine, llama, None, [end], Limits(), sessions)
    with ServerThread(app) as server:
        session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
        client = client_for(server, session)
        tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "6*7?"}]
        first = client.chat.completions.create(model="m", messages=messages, tools=tools)
        (tool_call,) = first.choices[0].message.tool_calls
        assert tool_call.function.name == "calc"
        assert json.loads(tool_call.function.arguments) == {"expression": "6*7"}
        assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content == ""
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "42"},
        ]
        second = client.chat.completions.create(model="m", messages=messages, tools=tools)
        answer = second.choices[0].message
        assert answer.content == "the result is 42" and not answer.tool_calls
        prompt = llama.decode(list(engine.requests[1].prompt_ids))
        result = '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
        assert prompt.endswith(result + "<|start_header_id|>assistant<|end_header_id|>\n\n")
        (branch,) = sessions.get(session).branches
        trained = [t for t, kept in zip(branch.token_ids, branch.trained) if kept]
        assert trained == [*engine.replies_given[0], *engine.replies_given[1]]
        forced = {"type": "function", "function": {"name": "calc"}}
        third = client.chat.completions.create(
            model="m", messages=messages[:1], tools=tools, tool_choice=forced
        )
        assert json.loads(third.choices[0].message.tool_calls[0].function.arguments) == {"expression": "7*6"}
        opening = '{"name": "calc", "parameters": '
        assert llama.decode(list(engine.requests[2].prompt_ids)).endswith(f"<|end_header_id|>\n\n{opening}")


def test_a_response_cut_at_its_length_limit_is_incomplete() -> None:
    from roll.serving.responses import response_object

    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    choice = {"message": {"role": "assistant", "content": "ab"}, "finish_reason": "length"}
    cut = response_object({"choices": [choice], "model": "m", "usage": usage}, {"max_output_tokens": 2})
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "ab" and cut["usage"]["output_tokens"] == 2


def test_a_stop_string_of_several_tokens_ends_generation_at_the_token_that_completes_it(tiny_server) -> None:
    """The engine stops at the token whose text completes the stop string; the reply's text ends before
    it, as the API's does; the ids returned for training are all the sampled ones."""
    engine, _, server, tokenizer = tiny_server
    client = client_for(server)
    free = client.completions.create(model="tiny", prompt="7+", max_tokens=8, temperature=0)
    text, ids = free.choices[0].text, engine.results[-1].token_ids
    assert len(ids) == 8 and len(text) == 8  # one character a token
    stop = text[3:5]
    end = text.find(stop) + len(stop)  # its first occurrence, completed by the token at end - 1
    stopped = client.completions.create(model="tiny", prompt="7+", max_tokens=8, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and engine.results[-1].token_ids == ids[:end]
    assert stopped.choices[0].text == text[: text.find(stop)]


def test_a_stopped_reply_is_cut_before_its_stop_and_the_next_turn_closes_it(scripted, bpe) -> None:
    """Against a merge-prone tokenizer: the reply's text ends before the stop string, every sampled id is
    recorded as trained, and the continuation closes the turn the stop left open (its end-of-turn token
    is rendered, masked), so the next prompt is the template's rendering of the conversation."""
    engine, sessions, server = scripted
    end = bpe.convert_tokens_to_ids(IM_END)
    sampled = bpe.encode("RR DD RRR")
    second = [*bpe.encode("LL"), end]
    engine.replies = [sampled, second]
    session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
    client = client_for(server, session)
    messages = [{"role": "user", "content": "RR"}]
    first = client.chat.completions.create(model="agent", messages=messages, stop=["DD", "<|im_end|>"])
    assert first.choices[0].message.content == "RR "
    request = engine.requests[0]
    assert request.params.stop == ("DD",) and request.params.stop_token_ids == (end,)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "LL"}]
    client.chat.completions.create(model="agent", messages=messages)
    (branch,) = sessions.get(session).branches
    first_prompt = list(request.prompt_ids)
    assert branch.token_ids[len(first_prompt) : len(first_prompt) + len(sampled)] == sampled
    assert branch.trained.count(True) == len(sampled) + len(second)
    after = engine.requests[1].prompt_ids[len(first_prompt) + len(sampled)]
    assert after == end  # the turn closed after the sampled ids, not left open


def test_tool_choice_required_or_named_starts_the_call_and_the_model_writes_the_rest(scripted, bpe) -> None:
    """``tool_choice`` required, or a named function, puts the call's opening as the template writes it
    after the generation prompt (prompt ids: masked), and the reply is parsed with it; what the model
    sampled after it is all that trains."""
    engine, sessions, server = scripted
    end = bpe.convert_tokens_to_ids(IM_END)
    tools = [
        {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    ]
    messages = [{"role": "user", "content": "6*7?"}]
    named = [*bpe.encode('{"expression": "6*7"}}</tool_call>'), end]
    required = [*bpe.encode('{"name": "search", "arguments": {"q": "RR"}}</tool_call>'), end]
    engine.replies = [named, required]
    session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
    client = client_for(server, session)
    choice = {"type": "function", "function": {"name": "calc"}}
    first = client.chat.completions.create(model="agent", messages=messages, tools=tools, tool_choice=choice)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "6*7"}
    assert first.choices[0].finish_reason == "tool_calls"
    opening = bpe.encode('<tool_call>{"name": "calc", "arguments": ', add_special_tokens=False)
    assert list(engine.requests[0].prompt_ids[-len(opening) :]) == opening
    (branch,) = sessions.get(session).branches
    assert [t for t, trained in zip(branch.token_ids, branch.trained) if trained] == named

    second = client_for(server).chat.completions.create(
        model="agent", messages=messages, tools=tools, tool_choice="required"
    )
    assert second.choices[0].message.tool_calls[0].function.name == "search"
    assert bpe.decode(list(engine.requests[1].prompt_ids)).endswith("<|im_start|>assistant\n<tool_call>")
    with pytest.raises(openai.BadRequestError, match="tool_choice: 'nope' is not one of the tools"):
        client.chat.completions.create(
            model="agent",
            messages=messages,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="needs tools to call"):
        client.chat.completions.create(model="agent", messages=messages, tool_choice="required")


def test_a_streamed_reply_is_the_reply_and_a_changed_tool_list_forks(scripted, bpe) -> None:
    """``stream: true`` gets server-sent chunks the openai client assembles into the same reply (tool calls
    and usage included), recorded as any call is; a call whose tool list changed is rendered whole with
    the new tools, so it forks instead of continuing the branch rendered with the old ones."""
    engine, sessions, server = scripted
    end = bpe.convert_tokens_to_ids(IM_END)
    engine.replies = [[*bpe.encode(TOOL_REPLY), end], [*bpe.encode("the result is 42"), end]]
    session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
    client = client_for(server, session)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "6*7?"}]
    chunks = list(
        client.chat.completions.create(
            model="agent", messages=messages, tools=tools, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    (call,) = [call for delta in deltas for call in delta.tool_calls or []]
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "6*7"}
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(engine.results[0].token_ids)
    assert sessions.get(session).branches[0].trained.count(True) == len(engine.results[0].token_ids)

    reply = {"role": "assistant", "content": "", "tool_calls": [call.model_dump(exclude={"index"})]}
    messages += [reply, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    other_tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    client.chat.completions.create(model="agent", messages=messages, tools=other_tools)
    recorded = sessions.get(session)
    assert recorded.stats()["forks"] == 1 and len(recorded.branches) == 2
    assert '"search"' in bpe.decode(list(engine.requests[1].prompt_ids))  # rendered with the new tools


def test_what_the_server_cannot_honour_is_refused_naming_the_field(scripted, bpe) -> None:
    engine, _, server = scripted
    client = client_for(server)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="response_format: only type text"):
        client.chat.completions.create(model="agent", messages=hi, response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls: false is not supported"):
        client.chat.completions.create(model="agent", messages=hi, parallel_tool_calls=False)
    with pytest.raises(openai.BadRequestError, match="stream: streaming is served for chat completions only"):
        client.completions.create(model="agent", prompt="hi", stream=True)
    engine.replies = [[bpe.convert_tokens_to_ids(IM_END)]] * 2
    client.chat.completions.create(model="agent", messages=hi, response_format={"type": "text"})
    client.chat.completions.create(model="agent", messages=hi, parallel_tool_calls=True)
    assert len(engine.requests) == 2


def test_bad_requests_get_the_apis_errors_naming_what_to_change(scripted, bpe) -> None:
    engine, _, server = scripted
    engine.replies = [[bpe.convert_tokens_to_ids(IM_END)]]
    client = client_for(server)
    with pytest.raises(
        openai.NotFoundError, match="model 'gpt-4' does not exist; this server serves 'agent'"
    ):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="session 'nope' does not exist"):
        client_for(server, "nope").chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "hi"}]
        )
    client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": "hi"}], logprobs=False
    )
    with pytest.raises(openai.BadRequestError, match="seed: not supported by this server"):
        client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}], seed=1)
    with pytest.raises(openai.BadRequestError, match="messages: List should have at least 1 item"):
        client.chat.completions.create(model="agent", messages=[])
    with pytest.raises(openai.BadRequestError, match="stop: each stop sequence must be a non-empty string"):
        client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}], stop="")
    bad_json = httpx.post(server.base_url + "/v1/chat/completions", content=b'{"model": "agent", ')
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    huge = httpx.post(server.base_url + "/v1/completions", json={"model": "agent", "prompt": "R" * 5000})
    assert huge.status_code == 413 and "at most 4096" in huge.json()["error"]["message"]
    too_long = httpx.post(
        server.base_url + "/v1/completions", json={"model": "agent", "prompt": "R", "max_tokens": 10**6}
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="n: at most 16 samples per request"):
        client.completions.create(model="agent", prompt="R", n=17)
    assert len(engine.requests) == 1  # only the call with neutral parameters reached the engine
    with pytest.raises(openai.InternalServerError, match="the server failed: IndexError"):  # no reply left
        client.completions.create(model="agent", prompt="R")


def test_more_requests_in_flight_than_the_bound_get_429(bpe) -> None:
    """With one request being answered and ``max_in_flight=1``, the next is told to retry (429, which
    OpenAI clients retry by themselves); the first still gets its answer."""
    end = bpe.convert_tokens_to_ids(IM_END)
    engine = ScriptedEngine([[end], [end]])
    reached, release = threading.Event(), threading.Event()
    answer = engine.await_result

    def held(request_id: str, timeout_s: float | None) -> GenerateResult:
        reached.set()
        release.wait(timeout=60)
        return answer(request_id, timeout_s)

    engine.await_result = held
    app = build_app(engine, bpe, "agent", [end], Limits(max_in_flight=1))
    with ServerThread(app) as server:
        first = {}
        call = threading.Thread(
            target=lambda: first.update(
                response=httpx.post(
                    server.base_url + "/v1/completions", json={"model": "agent", "prompt": "R"}, timeout=60
                )
            )
        )
        call.start()
        assert reached.wait(timeout=60)
        second = httpx.post(server.base_url + "/v1/completions", json={"model": "agent", "prompt": "R"})
        release.set()
        call.join(timeout=60)
    assert second.status_code == 429 and "retry" in second.json()["error"]["message"]
    assert first["response"].status_code == 200


def test_roll_serve_answers_an_openai_client_from_a_run_directory(tmp_path) -> None:
    """``roll serve RUN --port 0``: the run's final model on a free port, named in the line it prints."""
    import os
    import re
    import signal
    import subprocess
    import sys

    save_tiny_model(TINY, tmp_path / "run" / "model")
    command = [
        sys.executable,
        "-m",
        "roll.cli",
        "serve",
        str(tmp_path / "run"),
        "--port",
        "0",
        "--name",
        "policy",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in process.stdout:  # ends if the process dies: then the assertion below shows its output
            lines.append(line)
            if line.startswith("serving "):
                break
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", "".join(lines))
        assert found, "".join(lines)
        client = openai.OpenAI(base_url=found.group(1) + "/v1", api_key="-", max_retries=0, timeout=120)
        assert [model.id for model in client.models.list()] == ["policy"]
        completion = client.completions.create(model="policy", prompt="1+2=", max_tokens=3)
        assert completion.usage.prompt_tokens == 4 and completion.choices[0].finish_reason in (
            "stop",
            "length",
        )
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)


def test_a_request_over_its_time_bound_is_aborted_and_its_result_taken() -> None:
    """A request that does not finish within the bridge's bound raises TimeoutError (504 to the client)
    after it is aborted; its aborted result is then taken from the engine, which would keep it forever."""
    from roll.serving.engine_bridge import EngineBridge
    from roll.strategies.requests import SamplingParams

    class SlowEngine:
        def __init__(self) -> None:
            self.aborted, self.awaited = [], []

        def submit(self, request) -> None:
            self.request = request

        def await_result(self, request_id: str, timeout_s: float | None) -> GenerateResult:
            self.awaited.append(request_id)
            if request_id not in self.aborted:
                raise TimeoutError(f"request {request_id!r} did not finish within {timeout_s} s")
            return GenerateResult(request_id, [], [], "abort", [])

        def abort(self, request_id: str) -> bool:
            self.aborted.append(request_id)
            return True

    engine = SlowEngine()
    bridge = EngineBridge(engine, timeout_s=1.0)
    with pytest.raises(TimeoutError):
        asyncio.run(bridge.generate([1, 2], SamplingParams()))
    bridge.close(wait=True)
    request_id = engine.request.request_id
    assert engine.aborted == [request_id] and engine.awaited == [request_id, request_id]
