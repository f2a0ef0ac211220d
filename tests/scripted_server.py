"""A server over a scripted engine, for tests where the test chooses what the policy "samples" (merge-prone
ids, tool calls): a byte-level BPE tokenizer with a ChatML template that renders tools as Qwen2.5 and
Hermes do, and an engine that answers each request with the next scripted reply."""

from __future__ import annotations

import threading

from roll.models.tokenizer import build_bpe_tokenizer
from roll.strategies.requests import GenerateResult

# ChatML with tools as Qwen2.5 and Hermes render them: the tool list in the system turn, a call as
# <tool_call>{json}</tool_call> in the assistant's text, results in <tool_response> blocks.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ message['content'] }}"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["RR DD RRR LL", "RR RR DD", "the result is 42", '{"name": "calc"}'] * 30
TOOL_REPLY = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'


class ScriptedEngine:
    """Answers each request with the next of ``replies`` (token ids): what the policy "sampled", with
    logprob -0.5 and weights version 3 for each token. Records every request and result."""

    def __init__(self, replies: list[list[int]]):
        self.replies = list(replies)
        self.replies_given: list[list[int]] = []  # the replies taken, in order
        self.requests, self.results = [], []
        self._lock = threading.Lock()

    def submit(self, request) -> None:
        with self._lock:
            ids = self.replies.pop(0)
            self.replies_given.append(ids)
            self.requests.append(request)
            self.results.append(
                GenerateResult(request.request_id, ids, [-0.5] * len(ids), "stop", [3] * len(ids))
            )

    def await_result(self, request_id: str, timeout_s: float | None) -> GenerateResult:
        with self._lock:
            return next(result for result in self.results if result.request_id == request_id)

    def abort(self, request_id: str) -> bool:
        return False


def tool_tokenizer():
    """The merge-prone BPE tokenizer with ``TOOLS_CHATML`` as its template."""
    tokenizer = build_bpe_tokenizer(CORPUS, vocab_size=300)
    tokenizer.chat_template = TOOLS_CHATML
    return tokenizer
