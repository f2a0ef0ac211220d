"""An ``InferenceEngine`` awaited from asyncio: each request is submitted, then awaited on a thread of
the bridge's own pool (``await_result`` blocks), so many calls are in flight at once while the event loop
serves the rest. A call cancelled by its client aborts its request."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

__all__ = ["EngineBridge"]


class EngineBridge:
    """``engine``: an ``InferenceEngine``; at most ``max_in_flight`` requests wait at once (more wait for
    a thread); a request not finished within ``timeout_s`` is aborted and raises TimeoutError."""

    def __init__(self, engine: Any, max_in_flight: int = 256, timeout_s: float = 600.0):
        self.engine = engine
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="serving-await")

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        """``session``: the calls' session, the request's ``cache_key`` (the engine keeps its KV between
        them, and a scheduler behind the endpoint routes by it)."""
        request_id = f"serve-{uuid.uuid4().hex}"
        self.engine.submit(GenerateRequest(request_id, prompt_ids, params, cache_key=session))
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._pool, self.engine.await_result, request_id, self.timeout_s
            )
        except asyncio.CancelledError:
            self.engine.abort(request_id)  # the thread still waiting takes the aborted result
            raise
        except TimeoutError:
            self.engine.abort(request_id)
            self._pool.submit(self._forget, request_id)  # the engine holds each result until it is taken
            raise

    def _forget(self, request_id: str) -> None:
        try:
            self.engine.await_result(request_id, self.timeout_s)
        except Exception:  # noqa: BLE001 - nobody waits for it any more: only its memory matters
            pass

    def close(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
