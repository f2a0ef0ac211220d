"""Does a chat template keep a conversation's earlier turns as they were when a turn is appended?

A multi-turn episode is token-in-token-out: the ids of turn k (the ids the policy sampled, reasoning
and all) stay in the context of every later turn. Some templates rewrite history instead: Qwen3's drops
the ``<think>`` reasoning of every assistant turn before the last user message, so the context the
template would render for turn k+1 is not the one the policy sampled turn k in, and a model trained on
the sampled ids is trained on text it never sees at inference with that template.
"""

from __future__ import annotations

from typing import Any

# An assistant turn as a reasoning model writes it: what a history-rewriting template changes.
_REPLY = "<think>\nr\n</think>\n\ny"
# The turns rendered: two replies, so a template that treats the first turn specially is caught too.
_TURNS = 2


def history_rewrite(tokenizer: Any, system_prompt: str | None = None, name: str | None = None) -> str | None:
    """None when, for a conversation of N turns that ends with an assistant reply, the template's
    token ids are a prefix of those of the same conversation with one more user turn and the
    generation prompt (as a multi-turn episode renders it); else a message naming the tokenizer
    (``name``, default its path), the turn it rewrites, how, and what to do."""
    conversation: list[dict[str, str]] = (
        [{"role": "system", "content": system_prompt}] if system_prompt else []
    )
    for turn in range(1, _TURNS + 1):
        conversation += [{"role": "user", "content": f"q{turn}"}, {"role": "assistant", "content": _REPLY}]
        closed = _ids(tokenizer, conversation, generation_prompt=False)
        extended = _ids(
            tokenizer, [*conversation, {"role": "user", "content": "next"}], generation_prompt=True
        )
        if extended[: len(closed)] != closed:
            differs = next(
                (i for i, (a, b) in enumerate(zip(closed, extended, strict=False)) if a != b), len(extended)
            )
            start = max(0, differs - 8)
            alone = tokenizer.decode(closed[start:])
            followed = tokenizer.decode(extended[start:])
            # Cut the rewritten turn where it ends (its reply's last character and the template's
            # closing text), so the message shows the turn and not the one appended.
            close = alone[alone.rfind(_REPLY[-1]) :]
            if close in followed:
                followed = followed[: followed.index(close) + len(close)]
            name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            return (
                f"the chat template of {name} rewrites earlier turns when a turn is appended: assistant "
                f"turn {turn} renders as ...{alone!r} while it is the last turn, but as ...{followed!r} "
                "once a user turn follows (templates that strip earlier <think> reasoning, such as Qwen3's, "
                "do this). Multi-turn episodes keep the ids the policy sampled, so they need a template "
                "that renders history as written: set one in the model directory (chat_template.jinja or "
                "tokenizer_config.json's chat_template), or use another model"
            )
    return None


def _ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
