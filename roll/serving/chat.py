"""Chat messages to prompt ids through the model's chat template, and a reply's text and tool calls out
of the ids the policy sampled.

Tool calls are read in the format the template writes them in. Templates that render tools the way
Qwen2.5 and Hermes do (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's
text) get them parsed into the API's ``tool_calls``; a request with ``tools`` for a template that does not
render tools is refused, since the model would never see them. ``tool_choice`` ``required`` or a named
function is honoured by starting the reply with the call's opening as the template writes it
(``<tool_call>``, and the function's name): those ids are the prompt's (never trained), the model writes
the rest.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from roll.data.chat_turns import ChatTemplateError, ChatTurns
from roll.strategies.requests import stop_text_end

__all__ = ["ChatRenderer", "RenderError"]

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME, _ARGUMENTS = "roll_tool_name_7f3", {"roll_arg_7f3": 1}  # markers found in a rendered call


class RenderError(ValueError):
    """The chat template cannot render the request (an unknown role, tools it does not take)."""


class ChatRenderer:
    """Renders conversations for ``tokenizer`` (a Hugging Face tokenizer with a chat template), whose
    policy turns end with one of ``end_of_turn_ids``."""

    def __init__(self, tokenizer: Any, end_of_turn_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.renders_tools = "<tool_call>" in (getattr(tokenizer, "chat_template", None) or "")
        try:
            self._turns: ChatTurns | None = ChatTurns(tokenizer, end_of_turn_ids)
        except ChatTemplateError:
            self._turns = None  # every call is rendered whole (and a later call forks)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt ids of the whole conversation with the generation prompt."""
        if tools and not self.renders_tools:
            raise RenderError(
                "tools: the model's chat template does not render tools (no <tool_call> format)"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # noqa: BLE001 - jinja's raise_exception and template errors alike
            raise RenderError(f"messages: the model's chat template cannot render them: {error}") from error
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def call_opening(self, tools: list[dict[str, Any]], name: str | None) -> str:
        """The text a reply starts with when it must call a tool (``name``: that function; None: any): the
        template's rendering of an assistant turn with one call, up to the call's JSON (any tool) or up
        to its arguments (a named one)."""
        user = [{"role": "user", "content": "x"}]
        call = {"type": "function", "function": {"name": _NAME, "arguments": _ARGUMENTS}}
        turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        try:
            asked = self.tokenizer.apply_chat_template(
                user, tools=tools, add_generation_prompt=True, tokenize=False
            )
            whole = self.tokenizer.apply_chat_template([*user, turn], tools=tools, tokenize=False)
        except Exception as error:  # noqa: BLE001 - a template that cannot render a call
            raise RenderError(f"tool_choice: the chat template cannot render a tool call: {error}") from error
        reply = whole[len(asked) :] if whole.startswith(asked) else None
        start = -1 if reply is None else reply.find("<tool_call>")
        if reply is None or start < 0 or _NAME not in reply:
            raise RenderError("tool_choice: the chat template writes no <tool_call> this server can start")
        opened = start + len("<tool_call>")
        opened += len(reply[opened:]) - len(reply[opened:].lstrip())  # the whitespace before the JSON
        if name is None:
            return reply[:opened]
        arguments = reply.find(json.dumps(_ARGUMENTS), opened)
        if arguments < 0:
            raise RenderError(
                "tool_choice: the chat template writes a call's arguments in a form this server cannot start"
            )
        return reply[:arguments].replace(_NAME, json.dumps(name)[1:-1])

    def continue_after(self, messages: list[dict[str, Any]], turn_closed: bool) -> list[int] | None:
        """The ids that follow a policy turn when ``messages`` come next, or None where the template cannot
        render them as a continuation (the call is then rendered whole)."""
        if self._turns is None:
            return None
        try:
            return self._turns.continuation_ids(messages, turn_closed)
        except Exception:  # noqa: BLE001 - a template that cannot continue: the call forks instead
            return None

    def reply(
        self, token_ids: Sequence[int], stops: tuple[str, ...] = (), opening: str = ""
    ) -> tuple[str, list[dict[str, Any]]]:
        """The reply's text (after ``opening``, the ids a forced call started it with), ending before the
        first of ``stops`` in it, and its tool calls (API form,
        arguments as a JSON string). A block that is not a JSON object with a name stays in the text: the
        agent sees what the model wrote."""
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        text = opening + text[: stop_text_end(text, stops)]
        if not self.renders_tools:
            return text, []
        calls, kept = [], text
        for match in TOOL_CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            arguments = call.get("arguments", {})
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            )
            kept = kept.replace(match.group(0), "", 1)
        return (kept.strip() if calls else text), calls
