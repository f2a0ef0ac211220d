"""An agent program that multiplies with a calculator tool, written with the plain ``openai`` client:
nothing of ROLL is imported. ``roll train examples/agent_calculator.yaml`` trains the model behind the
client on it; any OpenAI-compatible server (``roll serve``, vLLM, a hosted API) can run it as is.

The task is a row of examples/data/multiply_tasks.jsonl: ``{"question": "37*48", "answer": 1776}``. The
model sees the question and may call ``calc`` through the API's tool calls; the agent runs the call and
sends the result back as a tool message; the model's next reply is its answer. The reward is 1.0 for the
right product, else 0.0.
"""

from __future__ import annotations

import json
import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "description": "a product such as 37*48"}},
                "required": ["x"],
            },
        },
    }
]
PRODUCT = re.compile(r"\s*(\d{1,6})\s*\*\s*(\d{1,6})\s*")


def calc(arguments: str) -> str:
    """The tool: a product of two integers, parsed (never evaluated)."""
    try:
        match = PRODUCT.fullmatch(json.loads(arguments).get("x", ""))
    except (json.JSONDecodeError, AttributeError, TypeError):
        match = None
    return str(int(match[1]) * int(match[2])) if match else "error"


async def run(client, task: dict) -> float:
    messages = [{"role": "user", "content": task["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    if message.tool_calls:  # one call, then the answer
        call = message.tool_calls[0]
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(call.function.arguments)})
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
    return float((message.content or "").strip() == str(task["answer"]))
