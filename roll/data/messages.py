"""Prompts as text or as a conversation: a list of ``{role, content}`` messages (the chat format of
Hugging Face datasets), checked row by row before anything renders them."""

from __future__ import annotations

from typing import Any

from roll.data.dataset import DatasetError

Messages = list[dict[str, Any]]


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
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _checked_parts(message["content"], where, column, i)}
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), (str, list))
        ):
            raise DatasetError(
                f"{where}: message {i} of the prompt ('{column}') is {message!r}; each message must be an "
                "object with a text 'role' and a 'content' that is text or a list of content parts"
            )
        messages.append(message)
    if not any(content_text(m["content"]).strip() or image_parts(m["content"]) for m in messages):
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


def _checked_parts(parts: list, where: str, column: str, index: int) -> list[dict]:
    """A message's content parts (OpenAI's and Hugging Face's chat format): ``{"type": "text", "text"}``
    and ``{"type": "image"}`` (the image itself comes from the row's image column)."""
    checked = []
    for part in parts:
        if isinstance(part, dict):
            part = {key: value for key, value in part.items() if value is not None}
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            checked.append({"type": "text", "text": part["text"]})
        elif isinstance(part, dict) and part.get("type") == "image":
            checked.append({"type": "image"})
        else:
            raise DatasetError(
                f"{where}: message {index} of the prompt ('{column}') has the content part {part!r}; a part "
                "is {'type': 'text', 'text': ...} or {'type': 'image'}"
            )
    return checked


def content_text(content: str | list[dict]) -> str:
    """A message content's text: the text itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def image_parts(content: str | list[dict]) -> int:
    """How many image parts a message content has."""
    return 0 if isinstance(content, str) else sum(1 for part in content if part["type"] == "image")


def with_images(prompt: str | Messages, count: int) -> Messages:
    """A prompt whose row has ``count`` images, as a conversation with one image part per image: a
    conversation that places its images keeps them where they are; otherwise they go first in the first
    user message (as Qwen2-VL's examples place them)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if any(image_parts(m["content"]) for m in messages):
        return messages
    first_user = next((m for m in messages if m["role"] == "user"), messages[-1])
    content = first_user["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    first_user["content"] = [{"type": "image"} for _ in range(count)] + text
    return messages


def prompt_text(prompt: Any) -> str:
    """A row's prompt as plain text, for readers that want words (a judge): a conversation as one
    ``role: content`` line per message (an image as ``<image>``), anything else as ``str`` gives it."""
    if isinstance(prompt, list):
        return "\n".join(f"{m['role']}: {_plain(m['content'])}" for m in prompt)
    return str(prompt)


def _plain(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] if part["type"] == "text" else "<image>" for part in content)
