"""The Responses API's core (``POST /v1/responses``) as a translation to and from chat completions, so a
Responses call is a chat call over the same sessions and records the same token ids.

In: ``input`` (a string, or items: messages with text parts, the ``function_call`` items of earlier
replies and the ``function_call_output`` items answering them), ``instructions`` (a system message first),
function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (text only, as chat's ``response_format``). Out: a ``response`` object whose
``output`` is a message item (when the reply has text) and a ``function_call`` item per call, ``status``
``incomplete`` (``max_output_tokens``) where the reply stopped at its length limit, and the usage.

Refused, naming the field: ``previous_response_id`` and ``conversation`` (no response is stored here: send
the whole input, as ``store: false`` clients do), ``stream`` (chat completions stream; a Responses call is
answered whole), tools other than functions (web or file search, computer use run at OpenAI), ``reasoning``,
``include`` of anything, input items other than the three above (images, files, reasoning items), and
``n``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from roll.serving.protocol import UNSUPPORTED, ApiError

__all__ = ["chat_body", "response_object"]

# Keys a chat request has too: refused there when set (top_logprobs, seed, ...) or passed on as they are.
SHARED = ("model", "temperature", "top_p", "parallel_tool_calls", *UNSUPPORTED)
REFUSED = {
    "previous_response_id": "no response is stored here: send the whole conversation as input",
    "conversation": "no conversation is stored here: send the whole conversation as input",
    "stream": "a Responses call is answered whole here (chat completions stream)",
    "reasoning": "the policy has no reasoning settings",
    "background": "calls are answered while the client waits",
    "prompt": "stored prompts live at OpenAI: send instructions and input",
    "n": "one reply per Responses call",
}


def chat_body(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request that a Responses request ``raw`` asks for.

    Raises:
        ApiError: 400 naming the field that is refused (see the module docstring) or malformed.
    """
    for key, why in REFUSED.items():
        if raw.get(key) not in (None, False):
            raise ApiError(400, f"{key}: not supported by this server ({why}); leave it unset", key)
    if raw.get("include"):
        raise ApiError(400, "include: nothing extra can be included here; leave it empty", "include")
    body: dict[str, Any] = {key: raw[key] for key in SHARED if key in raw}
    messages = [{"role": "system", "content": raw["instructions"]}] if raw.get("instructions") else []
    messages += _messages(raw.get("input"))
    body["messages"] = messages
    if raw.get("max_output_tokens") is not None:
        body["max_tokens"] = raw["max_output_tokens"]
    if raw.get("tools"):
        body["tools"] = [_tool(tool, index) for index, tool in enumerate(raw["tools"])]
    choice = raw.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            shapes = '"auto", "none", "required" or {"type": "function", "name": ...}'
            raise ApiError(400, f"tool_choice: {shapes}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        body["tool_choice"] = choice
    text_format = (raw.get("text") or {}).get("format")
    if text_format is not None:
        body["response_format"] = text_format
    return body


def _messages(given: Any) -> list[dict[str, Any]]:
    """Responses ``input`` as chat messages: consecutive ``function_call`` items are one assistant message
    with those tool calls (joined to the assistant message before them, as chat writes a reply)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input: a string, or a non-empty list of input items", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        where = f"input[{index}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: user, assistant, system or developer", f"{where}.role")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        else:
            raise ApiError(
                400,
                f"{where}.type: {kind!r} is not served here (messages, function_call and "
                "function_call_output items are)",
                f"{where}.type",
            )
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}.content: {kind!r} parts are not served here; send text", where)
        texts.append(part.get("text", ""))
    return "".join(texts)


def _tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (``{"type": "function", "name", "parameters", ...}``) in chat's form."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        where = f"tools[{index}]"
        raise ApiError(400, f"{where}.type: {kind!r} tools are not served here; only function tools", where)
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def response_object(completion: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's ``response`` for the chat ``completion`` that answered request ``raw``."""
    (choice,) = completion["choices"]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        text = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    for call in message.get("tool_calls") or []:
        function = call["function"]
        arguments = function["arguments"]
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                "status": "completed",
            }
        )
    cut = choice["finish_reason"] == "length"
    usage = completion["usage"]
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": completion["model"],
        "instructions": raw.get("instructions"),
        "output": output,
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "tool_choice": raw.get("tool_choice", "auto"),
        "tools": raw.get("tools") or [],
        "temperature": raw.get("temperature"),
        "top_p": raw.get("top_p"),
        "max_output_tokens": raw.get("max_output_tokens"),
        "text": raw.get("text") or {"format": {"type": "text"}},
        "metadata": raw.get("metadata") or {},
        "store": False,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }
