"""Sessions: an agent's calls recorded as token ids, in branches that only ever grow.

A branch is one context the agent kept extending: its token ids, and for each whether the policy sampled
it (trained) or not (the prompt, tool results: masked), with the sampled tokens' logprobs and weights
versions. A call extends the branch whose tokens its prompt starts with. When no branch's tokens are a
prefix of the prompt (the agent edited its history, a template re-rendered an earlier turn, a sub-agent
opened another context) the call forks a new branch: it keeps the tokens it shares with the closest
branch as that branch recorded them, and everything after is masked, whatever it decodes to. So a token
is trained only where it sits exactly as the policy sampled it.

Chat calls find their branch by conversation, not by text: a request whose messages start with a
branch's conversation (its last message the assistant reply this server returned), with the same tools,
continues that branch with the rest rendered as a chat-template delta (``roll.data.chat_turns``); a
changed tool list is rendered whole (the template writes the tools at the start), so it forks. The
policy's own tokens are never decoded and encoded again.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll.strategies.requests import GenerateResult

__all__ = ["Branch", "Session", "SessionStore", "comparable"]


@dataclass
class Branch:
    """One context of a session. ``messages``: the chat conversation whose tokens these are, ending with
    the reply this server returned (None for plain completions); ``turn_closed``: the last call ended
    with the turn's closing token (a continuation starts after it), not at its length limit or a stop
    of the caller's (then the continuation closes the turn first)."""

    token_ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # the tool list its conversation was rendered with
    turn_closed: bool = True
    calls: int = 0

    def extend(
        self, token_ids: Sequence[int], result: GenerateResult | None = None, closes_turn: bool | None = None
    ) -> None:
        """Append ``token_ids`` masked, then ``result``'s sampled tokens trained; ``closes_turn``: whether
        its last token closed the turn (None: whether it ended with finish reason stop)."""
        self.token_ids += token_ids
        self.trained += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.weight_versions += [-1] * len(token_ids)
        if result is not None:
            self.token_ids += result.token_ids
            self.trained += [True] * len(result.token_ids)
            self.logprobs += result.logprobs
            self.weight_versions += result.weight_versions or [-1] * len(result.token_ids)
            self.turn_closed = result.finish_reason == "stop" if closes_turn is None else closes_turn
            self.calls += 1

    def head(self, length: int) -> Branch:
        """A new branch holding this one's first ``length`` tokens as recorded."""
        return Branch(
            self.token_ids[:length],
            self.trained[:length],
            self.logprobs[:length],
            self.weight_versions[:length],
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "trained": self.trained,
            "logprobs": self.logprobs,
            "weight_versions": self.weight_versions,
            "calls": self.calls,
        }


class Session:
    """One episode's calls. Thread-safe: an agent may call concurrently (parallel tool calls, n > 1)."""

    def __init__(self, session_id: str):
        self.id = session_id
        self.branches: list[Branch] = []
        self.forks = 0  # calls whose prompt extended no branch and was not all recorded tokens
        self.calls = 0
        self.reward: float | None = None  # posted by the agent (POST /rl/sessions/<id>/reward)
        self._lock = threading.Lock()

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        render: Callable[[list[dict[str, Any]]], list[int]],
        continue_after: Callable[[list[dict[str, Any]], bool], list[int] | None],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt ids of a chat call: a branch's tokens and the rendered rest of the conversation,
        when ``messages`` (``comparable`` form) continue a branch's conversation; else ``render(messages)``
        (a fork, unless it is the first call). ``continue_after(rest, turn_closed)``: the ids after a
        policy turn, or None where the template cannot render ``rest`` as a continuation."""
        with self._lock:
            for branch in reversed(self.branches):
                known = branch.messages
                if known is None or len(messages) <= len(known) or messages[: len(known)] != known:
                    continue
                if (branch.tools or None) != (tools or None):
                    break  # rendered whole with the new tools: a fork
                rest = continue_after(messages[len(known) :], branch.turn_closed)
                if rest is not None:
                    return branch.token_ids + rest
                break
        return render(messages)

    def record(
        self,
        prompt_ids: Sequence[int],
        result: GenerateResult,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        closes_turn: bool | None = None,
    ) -> None:
        """Record a call: ``prompt_ids`` and what was sampled after them; ``messages``: the conversation
        with the reply, when a chat call (what a later call must start with to continue it), and the
        ``tools`` it was rendered with; ``closes_turn``: see ``Branch.extend``."""
        prompt = list(prompt_ids)
        with self._lock:
            self.calls += 1
            best, shared = None, 0
            for branch in reversed(self.branches):  # the latest branch wins ties
                length = _common_prefix(branch.token_ids, prompt)
                if length > shared:
                    best, shared = branch, length
            if best is not None and shared == len(best.token_ids):
                target = best
            else:
                if self.branches and shared < len(prompt):  # not only another sample after proven tokens
                    self.forks += 1
                target = best.head(shared) if best is not None else Branch()
                self.branches.append(target)
            target.extend(prompt[len(target.token_ids) :], result, closes_turn)
            target.messages, target.tools = messages, tools

    def stats(self) -> dict[str, int]:
        """``calls``, ``branches``, ``forks``, and the tokens ``trained`` and ``masked`` over all branches."""
        with self._lock:
            trained = sum(sum(branch.trained) for branch in self.branches)
            total = sum(len(branch.token_ids) for branch in self.branches)
            return {
                "calls": self.calls,
                "branches": len(self.branches),
                "forks": self.forks,
                "trained_tokens": trained,
                "masked_tokens": total - trained,
            }

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            branches = [branch.as_dict() for branch in self.branches]
        return {"id": self.id, **self.stats(), "reward": self.reward, "branches": branches}


class SessionStore:
    """The sessions a server holds, by id."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str | None = None) -> Session:
        return self.add(Session(session_id or uuid.uuid4().hex))

    def add(self, session: Session) -> Session:
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id!r} is already open")
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def close(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(session_id, None)


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message in one form, for comparing conversations and for the chat template: its role,
    content ("" for none), tool calls as ``{"type", "function": {"name", "arguments"}}`` with the
    arguments parsed from JSON where they are JSON (templates write them with ``tojson``), and
    ``tool_call_id`` and ``name`` when present. Fields clients add (``refusal``, ``annotations``) drop out."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_tool_call(call) for call in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _text(content: Any) -> str:
    """Content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as written: the template renders it as a string
    out = {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
