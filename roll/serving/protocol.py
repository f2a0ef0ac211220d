"""The OpenAI API's wire format as this server speaks it: the requests' schema (``ChatRequest``,
``CompletionRequest``), the bounds of what it answers (``Limits``), its error (``ApiError``), what
``tool_choice`` forces (``forced_tool``) and a chat completion as server-sent chunks (``chat_chunks``).
The routes are ``roll.serving.app``'s; the Responses API's translation is ``roll.serving.responses``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["UNSUPPORTED", "ApiError", "ChatRequest", "CompletionRequest", "Limits", "SamplingRequest"]
__all__ += ["chat_chunks", "forced_tool"]


@dataclass(frozen=True)
class Limits:
    """``max_request_bytes``: a request body's size; ``max_tokens``: tokens per response (and the default
    of a chat request that sets none); ``max_n``: samples per request; ``max_in_flight``: requests being
    answered at once (more get 429, which OpenAI clients retry); ``max_model_len``: prompt + response
    (None: the engine bounds it, as a training run's scheduler does per run); ``clamp_max_tokens``: a
    request asking for more tokens than these bounds leave gets what they leave
    instead of a 400 (a training run, where the run's budgets decide, not what an agent program asks)."""

    max_request_bytes: int = 1 << 20
    max_tokens: int = 4096
    max_n: int = 16
    max_in_flight: int = 256
    max_model_len: int | None = 2048
    clamp_max_tokens: bool = False


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# Parameters the engines cannot honour: set to anything but their neutral value, a request is refused
# rather than answered as if they had been applied.
UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "logprobs": None,
    "top_logprobs": None,
    "seed": None,
    "echo": False,
    "suffix": None,
    "best_of": None,
}


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send more (user, metadata): checked or ignored

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Honoured as the model samples: several calls in one reply are returned as several; false (at most
    # one) and a structured format would need constrained decoding, which this server does not do.
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    stream: bool = False


def forced_tool(payload: ChatRequest) -> str | None | bool:
    """What ``tool_choice`` forces: False (nothing: auto, none, unset), None (a call of any tool:
    required) or the name of the function to call."""
    choice = payload.tool_choice
    if choice in (None, "auto", "none"):
        return False
    names = [(tool.get("function") or {}).get("name") for tool in payload.tools or []]
    if not names:
        raise ApiError(400, f"tool_choice: {json.dumps(choice)} needs tools to call", "tool_choice")
    if choice == "required":
        return None
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise ApiError(
            400,
            f"tool_choice: {name!r} is not one of the tools ({', '.join(map(str, names))})",
            "tool_choice",
        )
    return name


def chat_chunks(completion: dict[str, Any], include_usage: bool) -> list[str]:
    """``completion`` as server-sent events of ``chat.completion.chunk``s: per choice its role and
    content, its tool calls, then its finish reason; the usage in a last chunk when asked for. The reply
    is generated whole first, so a stream carries it in a few chunks, not token by token."""
    head = {key: completion[key] for key in ("id", "created", "model")}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {**head, "object": "chat.completion.chunk", "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    events = []
    for choice in completion["choices"]:
        message, index = choice["message"], choice["index"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        events.append(chunk([{"index": index, "delta": delta, "finish_reason": None}]))
        if message.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            events.append(chunk([{"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}]))
        events.append(chunk([{"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}]))
    if include_usage:
        events.append(chunk([], usage=completion["usage"]))
    events.append("data: [DONE]\n\n")
    return events
