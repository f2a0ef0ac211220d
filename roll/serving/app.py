"""The OpenAI-compatible HTTP application (FastAPI).

Routes: ``POST /v1/chat/completions``, ``POST /v1/responses`` (the Responses API's core, translated to a
chat call: ``roll.serving.responses``), ``POST /v1/completions``, ``GET /v1/models``; the same under
``/sessions/<id>/v1`` record each call's token ids in that session (``roll.rollout.sessions``);
``POST /rl/sessions`` opens a session (its ``base_url`` is what an agent's client takes), ``GET
/rl/sessions/<id>`` returns what it recorded, ``POST /rl/sessions/<id>/reward`` (``{"reward": x}``) sets
its reward, ``DELETE`` closes it.

Every error is the API's error object (``{"error": {"message", "type", "param", "code"}}``) with a 4xx
status naming the field, or 5xx for the server's own failures; never a traceback. Request bodies, tokens
per response, samples per request and requests in flight are bounded.
"""

# No "from __future__ import annotations": FastAPI reads the routes' annotations (Request) at run time.
import asyncio
import json
import math
import time
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from roll.rollout.sessions import Session, SessionStore, comparable
from roll.serving.chat import ChatRenderer, RenderError
from roll.serving.engine_bridge import EngineBridge
from roll.serving.protocol import (
    UNSUPPORTED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Limits,
    SamplingRequest,
    chat_chunks,
    forced_tool,
)
from roll.serving.responses import chat_body, response_object
from roll.strategies.requests import GenerateResult, SamplingParams, stop_text_end

__all__ = ["Limits", "build_app"]


def build_app(
    engine: Any,
    tokenizer: Any,
    model_name: str | None,
    end_of_turn_ids: list[int],
    limits: Limits | None = None,
    sessions: SessionStore | None = None,
) -> Any:
    """The application serving ``engine`` (an ``InferenceEngine``) as ``model_name`` (None: as any name a
    request gives, listed as ``policy``: a training run's agent may name whichever model it was written
    for)."""
    from roll.serving import require_serving

    require_serving()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    limits = limits or Limits()
    store = sessions if sessions is not None else SessionStore()
    bridge = EngineBridge(engine, max_in_flight=limits.max_in_flight)
    renderer = ChatRenderer(tokenizer, end_of_turn_ids)
    in_flight = 0
    app = FastAPI(title=f"ROLL: {model_name}", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        body = {"message": error.message, "type": kind, "param": error.param, "code": error.code}
        return JSONResponse({"error": body}, status_code=error.status)

    @app.exception_handler(Exception)
    async def server_failure(_: Request, error: Exception) -> JSONResponse:
        message = f"the server failed: {type(error).__name__}: {error}"
        body = {"message": message, "type": "server_error", "param": None, "code": None}
        return JSONResponse({"error": body}, status_code=500)

    async def body_of(request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > limits.max_request_bytes:
            raise ApiError(413, f"the request body is {len(body)} bytes; at most {limits.max_request_bytes}")
        try:
            raw = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return raw

    async def parsed(request: Request, model: type[BaseModel]) -> Any:
        return validated(await body_of(request), model)

    def validated(raw: dict[str, Any], model: type[BaseModel]) -> Any:
        try:
            payload = model.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise ApiError(400, f"{field}: {first['msg']}", param=field) from None
        for name, neutral in UNSUPPORTED.items():
            value = raw.get(name)
            if value is not None and value is not False and value != neutral:
                raise ApiError(400, f"{name}: not supported by this server; leave it unset", param=name)
        if model_name is not None and payload.model != model_name:
            raise ApiError(
                404,
                f"model {payload.model!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )
        if payload.n > limits.max_n:
            raise ApiError(400, f"n: at most {limits.max_n} samples per request (got {payload.n})", "n")
        return payload

    def session_of(session_id: str | None) -> Session | None:
        if session_id is None:
            return None
        return present(store.get(session_id), session_id)

    def present(session: Session | None, session_id: str) -> Session:
        if session is None:
            raise ApiError(
                404, f"session {session_id!r} does not exist (never opened, or closed)", code="no_session"
            )
        return session

    def sampling(payload: SamplingRequest, prompt_length: int, max_tokens: int | None) -> SamplingParams:
        room = limits.max_tokens if limits.max_model_len is None else limits.max_model_len - prompt_length
        if room < 1:
            raise ApiError(
                400,
                f"the prompt is {prompt_length} tokens; the model takes {limits.max_model_len} in all",
                "messages" if isinstance(payload, ChatRequest) else "prompt",
            )
        given = min(limits.max_tokens, room)
        wanted = given if max_tokens is None else max_tokens
        if limits.clamp_max_tokens:
            wanted = min(wanted, given)
        if wanted > given:
            raise ApiError(
                400,
                f"max_tokens: {wanted} is more than this server gives ({given} "
                f"after a {prompt_length}-token prompt)",
                "max_tokens",
            )
        temperature = 1.0 if payload.temperature is None else payload.temperature
        return SamplingParams(
            max_new_tokens=wanted,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if payload.top_p is None else payload.top_p,
            greedy=temperature == 0,
            **stops(payload.stop),
        )

    special = set(getattr(tokenizer, "all_special_tokens", []) or []) | set(
        getattr(tokenizer, "get_added_vocab", dict)()
    )

    def stops(stop: str | list[str] | None) -> dict[str, tuple]:
        """The request's stop sequences: a special token (``<|im_end|>``, which a reply's text never shows)
        as its id, any other string as text, of any length (the engine stops at the token that completes
        it; the reply's text ends before it)."""
        given = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(text, str) or not text for text in given):
            raise ApiError(400, "stop: each stop sequence must be a non-empty string", "stop")
        ids = tuple(tokenizer.convert_tokens_to_ids(text) for text in given if text in special)
        return {"stop_token_ids": ids, "stop": tuple(text for text in given if text not in special)}

    async def sample(
        prompt_ids: list[int], params: SamplingParams, n: int, session: Session | None
    ) -> list[GenerateResult]:
        nonlocal in_flight
        if in_flight + n > limits.max_in_flight:
            raise ApiError(
                429, f"{in_flight} requests are being answered (at most {limits.max_in_flight}); retry"
            )
        in_flight += n
        try:
            key = session.id if session is not None else None
            results = await asyncio.gather(*(bridge.generate(prompt_ids, params, key) for _ in range(n)))
        except ValueError as error:  # the engine refused the request (e.g. vLLM and top_p)
            raise ApiError(400, str(error)) from None
        except TimeoutError as error:
            raise ApiError(504, f"generation did not finish: {error}") from None
        except RuntimeError as error:
            raise ApiError(500, f"generation failed: {error}") from None
        finally:
            in_flight -= n
        if any(result.finish_reason == "abort" for result in results):
            raise ApiError(503, "generation was aborted (the server is shutting down or restarting a worker)")
        return results

    def usage(prompt_ids: list[int], results: list[GenerateResult]) -> dict[str, int]:
        completion = sum(len(result.token_ids) for result in results)
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        }

    async def chat(request: Request, session_id: str | None = None) -> Any:
        payload: ChatRequest = await parsed(request, ChatRequest)
        completion = await answer(payload, session_id)
        if payload.stream:
            from fastapi.responses import StreamingResponse

            events = chat_chunks(completion, bool((payload.stream_options or {}).get("include_usage")))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return completion

    async def respond(request: Request, session_id: str | None = None) -> dict[str, Any]:
        raw = await body_of(request)
        payload: ChatRequest = validated(chat_body(raw), ChatRequest)
        return response_object(await answer(payload, session_id), raw)

    async def answer(payload: ChatRequest, session_id: str | None) -> dict[str, Any]:
        """The chat completion ``payload`` asks for, recorded in the session ``session_id`` names."""
        if payload.parallel_tool_calls is False:
            raise ApiError(
                400,
                "parallel_tool_calls: false is not supported (the reply holds the calls the model wrote, "
                "one or several); leave it unset",
                "parallel_tool_calls",
            )
        if (payload.response_format or {}).get("type", "text") != "text":
            raise ApiError(
                400,
                "response_format: only type text; this server does not constrain decoding to JSON (ask for "
                "JSON in the messages and parse the reply)",
                "response_format",
            )
        session = session_of(session_id)
        messages = [comparable(message) for message in payload.messages]
        tools = payload.tools if payload.tool_choice != "none" else None
        forced = forced_tool(payload)
        try:
            if session is None:
                prompt_ids = renderer.render(messages, tools)
            else:
                prompt_ids = session.chat_prompt(
                    messages, lambda m: renderer.render(m, tools), renderer.continue_after, tools
                )
            opening = "" if forced is False else renderer.call_opening(tools or [], forced)
        except RenderError as error:
            raise ApiError(
                400, str(error), "tool_choice" if "tool_choice" in str(error) else "messages"
            ) from None
        if opening:  # the call's opening is the prompt's: the model writes the rest, which alone trains
            prompt_ids = [*prompt_ids, *tokenizer.encode(opening, add_special_tokens=False)]
        params = sampling(payload, len(prompt_ids), payload.max_completion_tokens or payload.max_tokens)
        results = await sample(prompt_ids, params, payload.n, session)
        choices = []
        for index, result in enumerate(results):
            content, calls = renderer.reply(result.token_ids, params.stop, opening)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            if session is not None and result.token_ids:  # nothing sampled (a spent budget): nothing to train
                closes = result.token_ids[-1] in end_of_turn_ids
                session.record(prompt_ids, result, [*messages, comparable(message)], tools, closes)
            reason = "tool_calls" if calls else result.finish_reason
            choices.append({"index": index, "message": message, "finish_reason": reason, "logprobs": None})
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": payload.model,
            "choices": choices,
            "usage": usage(prompt_ids, results),
        }

    async def complete(request: Request, session_id: str | None = None) -> dict[str, Any]:
        payload: CompletionRequest = await parsed(request, CompletionRequest)
        if payload.stream:
            raise ApiError(400, "stream: streaming is served for chat completions only", "stream")
        session = session_of(session_id)
        if isinstance(payload.prompt, str):
            prompt_ids = list(tokenizer.encode(payload.prompt, add_special_tokens=False))
        else:
            prompt_ids = list(payload.prompt)
        if not prompt_ids:
            raise ApiError(400, "prompt: it encodes to no tokens", "prompt")
        if max(prompt_ids) >= len(tokenizer) or min(prompt_ids) < 0:
            raise ApiError(400, f"prompt: token ids must be in [0, {len(tokenizer)})", "prompt")
        params = sampling(payload, len(prompt_ids), payload.max_tokens or min(16, limits.max_tokens))
        results = await sample(prompt_ids, params, payload.n, session)
        choices = []
        for index, result in enumerate(results):
            if session is not None and result.token_ids:
                session.record(prompt_ids, result)
            text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
            text = text[: stop_text_end(text, params.stop)]
            choices.append(
                {"index": index, "text": text, "finish_reason": result.finish_reason, "logprobs": None}
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": payload.model,
            "choices": choices,
            "usage": usage(prompt_ids, results),
        }

    def models() -> dict[str, Any]:
        card = {"id": model_name or "policy", "object": "model", "created": 0, "owned_by": "roll"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_alone(request: Request) -> Any:
        return await chat(request)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_in_session(request: Request, session_id: str) -> Any:
        return await chat(request, session_id)

    @app.post("/v1/responses")
    async def respond_alone(request: Request) -> dict[str, Any]:
        return await respond(request)

    @app.post("/sessions/{session_id}/v1/responses")
    async def respond_in_session(request: Request, session_id: str) -> dict[str, Any]:
        return await respond(request, session_id)

    @app.post("/v1/completions")
    async def complete_alone(request: Request) -> dict[str, Any]:
        return await complete(request)

    @app.post("/sessions/{session_id}/v1/completions")
    async def complete_in_session(request: Request, session_id: str) -> dict[str, Any]:
        return await complete(request, session_id)

    app.get("/v1/models")(models)

    @app.get("/sessions/{session_id}/v1/models")
    def session_models(session_id: str) -> dict[str, Any]:
        session_of(session_id)
        return models()

    @app.post("/rl/sessions")
    def open_session() -> dict[str, str]:
        session = store.open()
        return {"id": session.id, "base_url": f"/sessions/{session.id}/v1"}

    @app.get("/rl/sessions/{session_id}")
    def read_session(session_id: str) -> dict[str, Any]:
        return session_of(session_id).as_dict()

    @app.post("/rl/sessions/{session_id}/reward")
    async def post_reward(request: Request, session_id: str) -> dict[str, Any]:
        session = present(store.get(session_id), session_id)
        body = await request.body()
        try:
            reward = json.loads(body).get("reward")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            reward = None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ApiError(400, 'reward: send {"reward": <a finite number>}', "reward")
        session.reward = float(reward)
        return {"id": session.id, "reward": session.reward}

    @app.delete("/rl/sessions/{session_id}")
    def close_session(session_id: str) -> dict[str, Any]:
        session = present(store.close(session_id), session_id)
        engine.release_prefixes([session_id])  # the KV kept between its calls
        return session.as_dict()

    @app.exception_handler(404)
    async def not_found(request: Request, _: Exception) -> JSONResponse:
        body = {
            "message": f"no route {request.method} {request.url.path}",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        return JSONResponse({"error": body}, status_code=404)

    return app
