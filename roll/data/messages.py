"""Prompts as text or as a conversation: a list of ``{role, content}`` messages (the chat format of
Hugging Face datasets), checked row by row before anything renders them."""

from __future__ import annotations

from typing import Any

from roll.data.dataset import DatasetError

Messages = list[dict[str, str]]


def checked_prompt(value: Any, where: str, column: str, chat_template: bool) -> str | Messages:
    """The prompt of one row: non-empty text, or a conversation that ends with a message the policy
    answers. Arrow-backed formats give every message every key of any message; the null ones are
    dropped, so the template sees each message as it was written.

    Raises:
        DatasetError: naming ``where`` and the ``column``, for a prompt of another type, an empty one, a
            malformed message, or a conversation while ``data.apply_chat_template`` is off.
    """
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: the prompt ('{column}') is empty; give every row a prompt")
        return value
    if not isinstance(value, list):
        raise DatasetError(
            f"{where}: the prompt ('{column}') is a {type(value).__name__}; it must be text or a list of "
            "{role, content} messages"
        )
    if not value:
        raise DatasetError(f"{where}: the prompt ('{column}') is an empty list of messages")
    messages = []
    for i, message in enumerate(value, start=1):
        if isinstance(message, dict):
            message = {key: part for key, part in message.items() if part is not None}
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: message {i} of the prompt ('{column}') is {message!r}; each message must be an "
                "object with a text 'role' and a text 'content'"
            )
        messages.append(message)
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: every message of the prompt ('{column}') is empty")
    if messages[-1]["role"] == "assistant":
        raise DatasetError(
            f"{where}: the prompt ('{column}') ends with an assistant message; a prompt ends with the "
            "message the policy answers (put the reference reply in the answer column instead)"
        )
    if not chat_template:
        raise DatasetError(
            f"{where}: the prompt ('{column}') is a list of messages, which only the tokenizer's chat "
            "template can render; set data.apply_chat_template=true"
        )
    return messages


def prompt_text(prompt: Any) -> str:
    """A row's prompt as plain text, for readers that want words (a judge): a conversation as one
    ``role: content`` line per message, anything else as ``str`` gives it."""
    if isinstance(prompt, list):
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return str(prompt)
