"""What every engine does with the requests it holds: each result handed over exactly once, to
``collect_finished`` (in finish order) or to ``await_result``, whichever comes first."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from roll.data.batch import Batch
from roll.strategies.requests import GenerateRequest, GenerateResult

# Starts the ids of requests an engine makes itself (``generate``'s rows, probes): they are awaited by
# their maker and never handed to ``collect_finished``. No caller's id starts with NUL.
INTERNAL_ID_PREFIX = "\x00"


class RequestsHeld:
    """A mixin for an ``InferenceEngine`` whose entries have ``request``, ``done`` (an Event),
    ``result`` and ``error``. The engine sets ``_state_lock``, ``_finished_ready`` (a Condition on it),
    ``_entries`` (id -> entry), ``_finished`` (a deque of ids) and ``_closed`` in its constructor
    (``_hold_requests``)."""

    _state_lock: threading.Lock
    _finished_ready: threading.Condition
    _entries: dict[str, Any]
    _finished: deque[str]
    _closed: bool

    def _hold_requests(self) -> None:
        self._state_lock = threading.Lock()
        self._finished_ready = threading.Condition(self._state_lock)
        self._entries = {}
        self._finished = deque()
        self._closed = False

    def collect_finished(self, timeout_s: float) -> list[GenerateResult]:
        """Hand over every finished single request at once; see ``InferenceEngine.collect_finished``."""
        deadline = time.monotonic() + timeout_s
        with self._state_lock:
            while True:
                results = self._take_finished()
                remaining = deadline - time.monotonic()
                if results or self._closed or remaining <= 0:
                    return results
                self._finished_ready.wait(remaining)

    def await_result(self, request_id: str, timeout_s: float | None) -> GenerateResult:
        """Wait for ``request_id``'s result and hand it over; see ``InferenceEngine.await_result``."""
        entry = self._await_entry(request_id, timeout_s)
        assert entry.result is not None  # done is set only after result or error
        return entry.result

    def _await_entry(self, request_id: str, timeout_s: float | None) -> Any:
        with self._state_lock:
            entry = self._entries.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id!r} is unknown: never submitted, or its result was collected")
        if not entry.done.wait(timeout_s):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout_s} s")
        with self._state_lock:
            if self._entries.get(request_id) is not entry:
                # Handed over while this call waited (collect_finished, another awaiter): exactly once.
                raise KeyError(f"request {request_id!r}'s result was collected by another call")
            del self._entries[request_id]
            if not request_id.startswith(INTERNAL_ID_PREFIX):  # internal ones never join the line
                self._finished.remove(request_id)
        if entry.error is not None:
            raise RuntimeError(f"generation of request {request_id!r} failed: {entry.error}") from entry.error
        return entry

    def _check_new_ids(self, requests: list[GenerateRequest]) -> None:
        """Raise unless every id is new and none repeats (caller holds the state lock)."""
        ids = [request.request_id for request in requests]
        taken = [i for i in ids if i in self._entries] or [i for i in set(ids) if ids.count(i) > 1]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use (unfinished or not yet awaited)")

    def _published(self, entry: Any) -> None:
        """``entry``'s outcome is set: wake its awaiter, and line it up for ``collect_finished`` (caller
        holds the state lock)."""
        entry.done.set()
        request_id = entry.request.request_id
        if not request_id.startswith(INTERNAL_ID_PREFIX):
            self._finished.append(request_id)
            self._finished_ready.notify_all()

    def _take_finished(self) -> list[GenerateResult]:
        """Remove and return the finished results nobody collected yet (caller holds the state lock).

        A failed request raises here; it is forgotten, while the results taken before it go back to the
        front of the line, so the next call still hands them over in finish order.
        """
        taken: list[str] = []
        while self._finished:
            request_id = self._finished.popleft()
            error = self._entries[request_id].error
            if error is not None:
                del self._entries[request_id]
                self._finished.extendleft(reversed(taken))
                raise RuntimeError(f"generation of request {request_id!r} failed: {error}") from error
            taken.append(request_id)
        results = []
        for request_id in taken:
            result = self._entries.pop(request_id).result
            assert result is not None  # finished without an error: a result was published
            results.append(result)
        return results


def results_as_batch(
    results: list[GenerateResult], max_new_tokens: int, pad_id: int, tokenizer: Any
) -> Batch:
    """Right-pad ``generate``'s results into its output tensors (one tensor build each)."""
    lengths = [len(result.token_ids) for result in results]
    padding = [max_new_tokens - length for length in lengths]
    response_ids = torch.tensor(
        [r.token_ids + [pad_id] * pad for r, pad in zip(results, padding)], dtype=torch.long
    ).view(len(results), max_new_tokens)
    mask = (torch.arange(max_new_tokens) < torch.tensor(lengths).unsqueeze(1)).long()
    logprobs = torch.tensor(
        [r.logprobs + [0.0] * pad for r, pad in zip(results, padding)], dtype=torch.float32
    ).view(len(results), max_new_tokens)
    out = Batch(
        tensors={"response_ids": response_ids, "response_mask": mask, "rollout_logprobs": logprobs},
        non_tensors={"finish_reason": [result.finish_reason for result in results]},
    )
    out["response_text"] = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return out
