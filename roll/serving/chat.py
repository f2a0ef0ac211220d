"""Chat messages to prompt ids through the model's chat template, and a reply's text and tool calls out
of the ids the policy sampled.

Tool calls are read in the format the template writes them in, found by rendering a probe call
(``ToolCallFormat``): Qwen2.5 and Hermes (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
in the assistant's text, several per reply) and Llama 3.1 and later (the reply is the call's JSON,
``{"name": ..., "parameters": {...}}``; several separated by ``;``) get them parsed into the API's
``tool_calls``; a request with ``tools`` for a template that writes calls in neither form is refused,
since the model would never see them or its calls would not be read. ``tool_choice`` ``required`` or a
named function is honoured by starting the reply with the call's opening as the template writes it
(``<tool_call>``, or ``{"name": "`` where the call is the whole reply; and the function's name): those ids
are the prompt's (never trained), the model writes the rest.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from roll.data.chat_turns import ChatTemplateError, ChatTurns
from roll.strategies.requests import stop_text_end

__all__ = ["HERMES", "LLAMA_JSON", "ChatRenderer", "RenderError", "ToolCallFormat"]

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME, _ARGUMENTS = "roll_tool_name_7f3", {"roll_arg_7f3": 1}  # markers found in a rendered call
_PROBE_TOOL = {"type": "function", "function": {"name": _NAME, "parameters": {"type": "object"}}}


@dataclass(frozen=True)
class ToolCallFormat:
    """How a chat template writes a tool call in the assistant's text: in ``<tool_call>`` blocks
    (``tagged``), or as the reply's whole text; the call's arguments under ``arguments_key``."""

    name: str
    tagged: bool
    arguments_key: str


HERMES = ToolCallFormat("hermes", tagged=True, arguments_key="arguments")  # Qwen2.5, Hermes
LLAMA_JSON = ToolCallFormat("llama3_json", tagged=False, arguments_key="parameters")  # Llama 3.1+


class RenderError(ValueError):
    """The chat template cannot render the request (an unknown role, tools it does not take)."""


class ChatRenderer:
    """Renders conversations for ``tokenizer`` (a Hugging Face tokenizer with a chat template), whose
    policy turns end with one of ``end_of_turn_ids``."""

    def __init__(self, tokenizer: Any, end_of_turn_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.tool_format = self._tool_format()
        try:
            self._turns: ChatTurns | None = ChatTurns(tokenizer, end_of_turn_ids)
        except ChatTemplateError:
            self._turns = None  # every call is rendered whole (and a later call forks)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt ids of the whole conversation with the generation prompt."""
        if tools and self.tool_format is None:
            raise RenderError(
                "tools: the model's chat template writes no tool calls in a format this server reads "
                '(Qwen/Hermes <tool_call> blocks, Llama 3.1 {"name", "parameters"} JSON)'
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # noqa: BLE001 - jinja's raise_exception and template errors alike
            raise RenderError(f"messages: the model's chat template cannot render them: {error}") from error
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _rendered_call(self, tools: list[dict[str, Any]]) -> str | None:
        """The template's rendering of an assistant turn holding one probe call (``_NAME`` with
        ``_ARGUMENTS``), after the generation prompt; None where it cannot render one."""
        user = [{"role": "user", "content": "x"}]
        call = {"type": "function", "function": {"name": _NAME, "arguments": _ARGUMENTS}}
        turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        try:
            asked = self.tokenizer.apply_chat_template(
                user, tools=tools, add_generation_prompt=True, tokenize=False
            )
            whole = self.tokenizer.apply_chat_template([*user, turn], tools=tools, tokenize=False)
        except Exception:  # noqa: BLE001 - a template without tools, or one that cannot render a call
            return None
        reply = whole[len(asked) :] if whole.startswith(asked) else None
        return reply if reply is not None and _NAME in reply else None

    def _tool_format(self) -> ToolCallFormat | None:
        reply = self._rendered_call([_PROBE_TOOL])
        if reply is None:
            return None
        if "<tool_call>" in reply:
            return HERMES
        if re.search(rf'\{{\s*"name":\s*"{_NAME}",\s*"parameters":', reply):
            return LLAMA_JSON
        return None

    def call_opening(self, tools: list[dict[str, Any]], name: str | None) -> str:
        """The text a reply starts with when it must call a tool (``name``: that function; None: any): the
        template's rendering of an assistant turn with one call, up to the call's JSON (any tool; up to
        its name where the call is the whole reply, so that the opening commits to a call) or up to its
        arguments (a named one)."""
        reply = self._rendered_call(tools) if self.tool_format is not None else None
        if reply is None:
            raise RenderError("tool_choice: the chat template writes no tool call this server can start")
        named = reply.index(_NAME)
        start = reply.rfind("{", 0, named)  # the call's JSON object
        if self.tool_format is HERMES:
            start = reply.find("<tool_call>")
            start += len("<tool_call>")
            start += len(reply[start:]) - len(reply[start:].lstrip())  # the whitespace before the JSON
        if name is None:
            return reply[:start] if reply[:start].strip() else reply[:named]
        arguments = reply.find(json.dumps(_ARGUMENTS), named)
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
        first of ``stops`` in it, and its tool calls (API form, arguments as a JSON string). A block that is
        not a JSON object with a name stays in the text (with the Llama format, a reply that is not all
        calls is an answer): the agent sees what the model wrote."""
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        text = opening + text[: stop_text_end(text, stops)]
        if self.tool_format is None:
            return text, []
        if not self.tool_format.tagged:  # the reply is its calls, or an answer
            calls = [self._call(body) for body in _json_objects(text)]
            return ("", calls) if calls and all(calls) else (text, [])  # type: ignore[return-value]
        calls, kept = [], text
        for match in TOOL_CALL.finditer(text):
            call = self._call(match.group(1))
            if call is not None:
                calls.append(call)
                kept = kept.replace(match.group(0), "", 1)
        return (kept.strip() if calls else text), calls

    def _call(self, body: str) -> dict[str, Any] | None:
        """A call's JSON as the API's tool call (arguments as a JSON string); None if it is not a JSON
        object with a name."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        assert self.tool_format is not None
        arguments = call.get(self.tool_format.arguments_key, call.get("arguments", {}))
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            },
        }


def _json_objects(text: str) -> list[str]:
    """The JSON objects that make up all of ``text`` (one, or several separated by ``;``), as Llama 3.1
    writes calls; none where anything else is in it (then it is an answer, not calls)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (objects and text[at] == ";")):
            at += 1
        if at == len(text):
            return objects
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return []
        if not isinstance(value, dict):
            return []
        objects.append(text[at:end])
        at = end
