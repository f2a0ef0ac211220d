"""An OpenAI-compatible endpoint over a rollout engine that records the token ids it samples.

- Sessions (``roll.rollout.sessions``, rollout data that the endpoint fills and the agent scheduler reads):
  each episode's calls as token ids, grown branch by branch; a call whose conversation does not extend a
  branch forks a new one, and tokens whose sampled origin cannot be proven are never trained.
- ``chat``: messages to prompt ids through the model's chat template, and tool calls out of its text.
- ``engine_bridge``: the asyncio side of an ``InferenceEngine``.
- ``app``: the FastAPI application (``/v1/chat/completions``, ``/v1/responses``, ``/v1/completions``,
  ``/v1/models``, and the same under ``/sessions/<id>/v1``); ``protocol``: the requests' schema, bounds,
  errors and streamed chunks; ``responses``: the Responses API as a chat call; ``server``: uvicorn in a
  thread, and ``roll serve``.

FastAPI, uvicorn and the openai client (for agents trained through it) are the ``serve`` extra: ``pip
install 'roll-rl[serve]'``.
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'roll-rl[serve]' (FastAPI, uvicorn and the openai client)"


def require_serving() -> None:
    """Raise an ImportError naming the extra when FastAPI, uvicorn or the openai client is missing."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"the OpenAI-compatible endpoint needs {' and '.join(missing)}: {INSTALL_HINT}")
