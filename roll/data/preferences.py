"""Preference pairs (prompt, chosen, rejected) in TRL's formats, tokenised once at load.

Standard rows hold text: the completion is trained straight after the prompt (rendered in the chat
template as one user message, when ``apply_chat_template`` is on) and ends with the end-of-sequence token.
Conversational rows hold ``{role, content}`` messages: the prompt a conversation, each completion the
assistant's reply; the template renders prompt + reply, so the completion ends the way the template closes
an assistant turn.

Either way a completion's ids are the ids of prompt + completion after the prompt's own ids, so the pair
is trained on exactly the tokens the model reads in one pass. That needs the prompt's tokens to be a prefix
of prompt + completion's: a tokenizer that merges across the boundary (a BPE joining the prompt's last
characters with the completion's first) breaks it, and such a row is an error at load that names it,
rather than a silent shift of one token. No torch at import: preflight loads data before any model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roll.data.columns import map_columns
from roll.data.dataset import DatasetError
from roll.data.formats import read_rows
from roll.data.messages import Messages, checked_prompt, content_text
from roll.data.prompts import check_representable, render_prompt

PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"
COMPLETIONS = (CHOSEN, REJECTED)


@dataclass
class PreferenceSet:
    """Pairs as token ids: each row's prompt, and its chosen and rejected completions (with their end)."""

    rows: list[dict]
    wheres: list[str]  # file:line or file row N of each pair, for messages
    prompt_ids: list[list[int]]
    chosen_ids: list[list[int]]
    rejected_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)

    def fingerprint(self) -> str:
        """A digest of every pair's token ids, in order: it changes with the data, the tokenizer, the chat
        template or the column mapping, and with nothing else (a cache key)."""
        digest = hashlib.sha256()
        for ids in zip(self.prompt_ids, self.chosen_ids, self.rejected_ids, strict=True):
            for part in ids:
                digest.update(len(part).to_bytes(4, "little"))
                digest.update(b"".join(i.to_bytes(4, "little") for i in part))
        return digest.hexdigest()


def load_preferences(
    path: str,
    tokenizer: Any,
    columns: Mapping[str, str],
    apply_chat_template: bool,
    max_prompt_length: int,
    max_completion_length: int,
    key: str = "data.columns",
) -> PreferenceSet:
    """Read and tokenise the pairs at ``path`` (any format ``read_rows`` reads).

    Raises:
        DatasetError: naming the file and line or row, for a missing or null field, an empty prompt or
            completion, a malformed conversation, text the tokenizer cannot represent, a prompt whose
            tokens are not a prefix of prompt + completion, or a prompt or completion over its length.
    """
    located = read_rows(path)
    rows = map_columns(located, columns, (PROMPT, *COMPLETIONS), key)
    pairs = PreferenceSet([], [], [], [], [])
    for (where, _), row in zip(located, rows, strict=True):
        prompt = checked_prompt(row[PROMPT], where, columns.get(PROMPT, PROMPT), apply_chat_template)
        completions = {
            name: _checked_completion(row[name], where, columns.get(name, name), prompt)
            for name in COMPLETIONS
        }
        texts = [prompt] if isinstance(prompt, str) else [content_text(m["content"]) for m in prompt]
        texts += [c if isinstance(c, str) else c[-1]["content"] for c in completions.values()]
        check_representable(tokenizer, texts, [where] * len(texts), "prompt, chosen or rejected")
        prompt_ids, (chosen, rejected) = _tokenised(
            tokenizer, prompt, completions, apply_chat_template, where
        )
        if len(prompt_ids) > max_prompt_length:
            raise DatasetError(
                f"{where}: the prompt is {len(prompt_ids)} tokens, longer than data.max_prompt_length="
                f"{max_prompt_length}; raise it or shorten the prompt"
            )
        for name, ids in (("chosen", chosen), ("rejected", rejected)):
            if len(ids) > max_completion_length:
                raise DatasetError(
                    f"{where}: the {name} completion is {len(ids)} tokens, longer than "
                    f"data.max_completion_length={max_completion_length}; raise it or shorten the completion"
                )
        pairs.rows.append(row)
        pairs.wheres.append(where)
        pairs.prompt_ids.append(prompt_ids)
        pairs.chosen_ids.append(chosen)
        pairs.rejected_ids.append(rejected)
    return pairs


def _checked_completion(value: Any, where: str, column: str, prompt: str | Messages) -> str | Messages:
    """A completion: non-empty text for a text prompt, one assistant message (or a list ending with one)
    for a conversation."""
    if isinstance(prompt, str):
        if not isinstance(value, str):
            raise DatasetError(
                f"{where}: '{column}' is a {type(value).__name__} but the prompt is text; a standard row's "
                "completions are text too"
            )
        if not value.strip():
            raise DatasetError(f"{where}: '{column}' is empty; every pair needs two non-empty completions")
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{where}: '{column}' must be a list holding the assistant's reply, e.g. "
            '[{"role": "assistant", "content": "..."}], since the prompt is a conversation'
        )
    messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
    last = messages[-1]
    if not (
        isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str)
    ):
        raise DatasetError(f"{where}: '{column}' must end with an assistant message {{role, content}}")
    if not last["content"].strip():
        raise DatasetError(f"{where}: '{column}' is empty; every pair needs two non-empty completions")
    return messages


def _tokenised(
    tokenizer: Any,
    prompt: str | Messages,
    completions: Mapping[str, str | Messages],
    apply_chat_template: bool,
    where: str,
) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids and each completion's: prompt + completion tokenised whole, the prompt's ids cut
    off the front."""
    prompt_text = render_prompt(tokenizer, prompt, apply_chat_template)
    prompt_ids = _encode(tokenizer, prompt_text)
    completion_ids = []
    for name, completion in completions.items():
        if isinstance(completion, str):
            full_ids = _encode(tokenizer, prompt_text + completion) + [tokenizer.eos_token_id]
        else:
            conversation = [*prompt, *completion]
            full_ids = _encode(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False))
        _check_prefix(tokenizer, prompt_ids, full_ids, where, name)
        completion_ids.append(full_ids[len(prompt_ids) :])
    return prompt_ids, completion_ids


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _check_prefix(
    tokenizer: Any, prompt_ids: Sequence[int], full_ids: Sequence[int], where: str, name: str
) -> None:
    if list(full_ids[: len(prompt_ids)]) == list(prompt_ids) and len(full_ids) > len(prompt_ids):
        return
    at = next((i for i, (a, b) in enumerate(zip(prompt_ids, full_ids)) if a != b), len(full_ids))
    raise DatasetError(
        f"{where}: the prompt's tokens are not a prefix of prompt + {name}'s (they differ at token {at}: "
        f"the prompt alone ends {tokenizer.decode(list(prompt_ids[at : at + 3]))!r}, joined it reads "
        f"{tokenizer.decode(list(full_ids[at : at + 3]))!r}), so the tokenizer merges across the boundary; "
        "end the prompt with a separator (a space or newline) the completion does not continue, or move it"
    )
