"""Agents written with the common frameworks, unchanged, against the endpoint: the OpenAI Agents SDK
(over the Responses API, its default, and Chat Completions), LangChain's ``ChatOpenAI`` and smolagents'
``OpenAIServerModel`` with a ``ToolCallingAgent``. Each calls a tool and answers through a session, over a
scripted engine (the test chooses what the policy "samples"), and the session holds exactly the sampled
ids as trained tokens.

Skipped where a framework is not installed (the ``test`` extra installs all three)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from scripted_server import ScriptedEngine, tool_tokenizer  # noqa: E402

from roll.models.tokenizer import IM_END  # noqa: E402
from roll.rollout.sessions import SessionStore  # noqa: E402
from roll.serving.app import Limits, build_app  # noqa: E402
from roll.serving.server import ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def bpe():
    return tool_tokenizer()


@pytest.fixture()
def served(bpe):
    """(engine, sessions, the base URL of a new session); ``engine.replies`` are what the policy says."""
    engine, sessions = ScriptedEngine([]), SessionStore()
    app = build_app(
        engine,
        bpe,
        None,
        [bpe.convert_tokens_to_ids(IM_END)],
        Limits(max_tokens=256, max_model_len=1 << 16),
        sessions,
    )
    with ServerThread(app) as server:
        session = httpx.post(server.base_url + "/rl/sessions").json()["id"]
        yield engine, sessions, f"{server.base_url}/sessions/{session}/v1", session


def say(bpe, *texts: str) -> list[list[int]]:
    """Each text as the ids the policy samples, closed by the end of its turn."""
    return [[*bpe.encode(text), bpe.convert_tokens_to_ids(IM_END)] for text in texts]


def trained_ids(sessions: SessionStore, session: str) -> list[list[int]]:
    """The trained ids of each branch of ``session``."""
    branches = sessions.get(session).branches
    return [[t for t, kept in zip(b.token_ids, b.trained) if kept] for b in branches]


CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


@pytest.mark.parametrize("transport", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_an_openai_agents_sdk_agent_calls_its_tool_and_answers(served, bpe, transport):
    """Over both of the SDK's model classes: the Responses API (its default) and Chat Completions."""
    agents = pytest.importorskip("agents")
    import openai

    engine, sessions, base_url, session = served
    engine.replies = say(bpe, CALL, "6 times 7 is 42")
    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = getattr(agents, transport)(model="policy", openai_client=client)
    agent = agents.Agent(name="calculator", instructions="Use the tool.", tools=[multiply], model=model)
    result = agents.Runner.run_sync(agent, "What is 6 times 7?")
    assert result.final_output == "6 times 7 is 42"
    assert "<tool_response>42</tool_response>" in bpe.decode(list(engine.requests[1].prompt_ids))
    assert trained_ids(sessions, session) == [engine.replies_given[0] + engine.replies_given[1]]


def test_a_langchain_chat_model_binds_tools_calls_one_and_streams_its_answer(served, bpe):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    engine, sessions, base_url, session = served
    engine.replies = say(bpe, CALL, "6 times 7 is 42")

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key="unused", max_retries=0).bind_tools(
        [multiply]
    )
    messages = [HumanMessage("What is 6 times 7?")]
    reply = llm.invoke(messages)
    (call,) = reply.tool_calls
    assert call["name"] == "multiply" and call["args"] == {"a": 6, "b": 7}
    messages += [reply, ToolMessage(str(multiply.invoke(call["args"])), tool_call_id=call["id"])]
    answer = "".join(chunk.content for chunk in llm.stream(messages))
    assert answer == "6 times 7 is 42"
    assert trained_ids(sessions, session) == [engine.replies_given[0] + engine.replies_given[1]]


def test_a_smolagents_tool_calling_agent_calls_its_tool_and_gives_its_final_answer(served, bpe):
    smolagents = pytest.importorskip("smolagents")

    engine, sessions, base_url, session = served
    # ToolCallingAgent asks for a call (tool_choice required): the endpoint writes "<tool_call>", the
    # policy the rest.
    engine.replies = say(
        bpe,
        '{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>',
        '{"name": "final_answer", "arguments": {"answer": "42"}}</tool_call>',
    )

    @smolagents.tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    model = smolagents.OpenAIServerModel(model_id="policy", api_base=base_url, api_key="unused")
    agent = smolagents.ToolCallingAgent(tools=[multiply], model=model, max_steps=3, verbosity_level=0)
    assert str(agent.run("What is 6 times 7?")) == "42"
    trained = trained_ids(sessions, session)
    assert sorted(sum(trained, [])) == sorted(engine.replies_given[0] + engine.replies_given[1])
