"""The calculator agent (``calculator.py``) written with the OpenAI Agents SDK instead of the plain
``openai`` client: an ``Agent`` with a ``function_tool``, run by ``Runner.run`` over the SDK's default
model class (the Responses API). Nothing of ROLL is imported; ``roll train
examples/agent_calculator_sdk.yaml`` trains the model behind the client it is given.

Needs the SDK: ``pip install 'roll-rl[agents]'`` (or ``openai-agents``).
"""

from __future__ import annotations

import re

try:
    import agents
except ImportError as error:  # the entrypoint is imported when the config loads: say what to install
    raise ImportError(f"{error}: the Agents SDK example needs pip install 'roll-rl[agents]'") from error

agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI
PRODUCT = re.compile(r"\s*(\d{1,6})\s*\*\s*(\d{1,6})\s*")


@agents.function_tool
def calc(x: str) -> str:
    """Multiply two integers.

    Args:
        x: a product such as 37*48.
    """
    match = PRODUCT.fullmatch(x)
    return str(int(match[1]) * int(match[2])) if match else "error"


async def run(client, task: dict) -> float:
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    agent = agents.Agent(name="calculator", tools=[calc], model=model)
    result = await agents.Runner.run(agent, task["question"], max_turns=2)
    return float(str(result.final_output).strip() == str(task["answer"]))
