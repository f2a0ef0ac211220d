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


# Llama 3.1's way with custom tools, after its published template: the tools as JSON in the first user
# message, a call as the assistant's whole reply {"name": ..., "parameters": ...}, results in an ipython
# turn, <|eot_id|> closing every turn.
LLAMA31_TOOLS = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none %}{%- set first_user_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
    "its value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
EOT = "<|eot_id|>"


def llama_tool_tokenizer():
    """The merge-prone BPE tokenizer with Llama 3.1's header and end-of-turn tokens and ``LLAMA31_TOOLS``."""
    tokenizer = build_bpe_tokenizer(CORPUS, vocab_size=300)
    tokens = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOT]
    tokenizer.add_special_tokens({"bos_token": tokens[0], "additional_special_tokens": tokens[1:]})
    tokenizer.chat_template = LLAMA31_TOOLS
    return tokenizer
