"""``HFEngine``: the inference-engine contract on Hugging Face ``generate`` (CPU, tests, small GPUs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from roll.data.batch import Batch
from roll.data.padding import left_pad
from roll.strategies import hf_generate
from roll.strategies.infer.base import GenerateRequest, GenerateResult, InferenceEngine, NamedTensors
from roll.strategies.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["HFEngine"]


@dataclass
class _Entry:
    """One submitted request and what became of it; fields are guarded by the engine's state lock."""

    request: GenerateRequest
    done: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    abort_requested: bool = False
    result: GenerateResult | None = None
    error: Exception | None = None


class _AbortCriterion(StoppingCriteria):
    """Stops the rows whose request was aborted and records how many tokens each had by then.

    HF ``generate`` calls stopping criteria once per new token with the full sequences
    [B, prompt + generated] and drops every row marked True from its unfinished set. A dropped row then
    receives the pad token at each later step, so the cut-off has to be recorded here: with pad == EOS
    (a common tokenizer setup) an aborted row would otherwise look like one that ended with EOS.
    """

    def __init__(self, size: int, prompt_length: int, aborted: Callable[[], list[bool]]) -> None:
        self.prompt_length = prompt_length
        self.aborted = aborted
        self.stopped_at: list[int | None] = [None] * size

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_length
        for row, flag in enumerate(self.aborted()):
            if flag and self.stopped_at[row] is None:
                self.stopped_at[row] = generated
        stopped = [at is not None for at in self.stopped_at]
        return torch.tensor(stopped, dtype=torch.bool, device=input_ids.device)


def _accelerator_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers that live off the CPU (tied tensors counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")


class HFEngine(InferenceEngine):
    """Serves ``model`` with Hugging Face ``generate``: batch generation and single requests.

    Single requests are run by one background thread that owns the model: each round it takes the
    oldest queued request and every other queued request with equal SamplingParams (at most
    ``max_batch_size``), left-pads their prompts and runs them as one ``generate`` call, so their
    tokens and logprobs are those of ``roll.strategies.hf_generate.generate`` on the same rows. An abort
    of a running request stops its row at the next token through a stopping criterion; the row's result
    is delivered when its batch ends, since ``generate`` returns all rows together.

    Args:
        model: a causal LM; moved to ``device`` and put in eval mode.
        tokenizer: gives the EOS and pad ids (pad falls back to EOS) and decodes ``response_text``.
        device: where the model runs; default: where its parameters are now.
        max_batch_size: most requests in one ``generate`` call (None: no limit).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device | str | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; generation could never stop with 'stop'")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self._device = torch.device(device) if device is not None else next(model.parameters()).device
        self._model = model.to(self._device).eval()
        self._tokenizer = tokenizer
        self._eos_id: int = tokenizer.eos_token_id
        self._pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eos_id
        self._max_batch_size = max_batch_size
        # torch's CPU thread count is per calling thread: generation in the serving thread or in another
        # thread of a threaded actor must use the count the constructing thread was given, not one.
        self._num_threads = torch.get_num_threads()
        # Lock order: _model_lock before _state_lock, never the reverse. _model_lock is held for every
        # use of the model (generation, weight copies, device moves) so weights never change mid-batch;
        # _state_lock guards the request book-keeping and is only held briefly.
        self._model_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._wakeup = threading.Condition(self._state_lock)
        self._entries: dict[str, _Entry] = {}
        self._queue: list[_Entry] = []
        self._released = False
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="hf-inference-engine", daemon=True)
        self._thread.start()

    # ----- single requests -------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> None:
        """Queue ``request``; see ``InferenceEngine.submit``."""
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"submit takes a GenerateRequest, got {type(request).__name__}")
        with self._state_lock:
            self._check_serving()
            if request.request_id in self._entries:
                raise ValueError(
                    f"request id {request.request_id!r} is already in use (unfinished or not yet awaited)"
                )
            entry = _Entry(request)
            self._entries[request.request_id] = entry
            self._queue.append(entry)
            self._wakeup.notify()

    def await_result(self, request_id: str, timeout_s: float | None) -> GenerateResult:
        """Wait for ``request_id``'s result and hand it over; see ``InferenceEngine.await_result``."""
        with self._state_lock:
            entry = self._entries.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id!r} is unknown: never submitted, or its result was collected")
        if not entry.done.wait(timeout_s):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout_s} s")
        with self._state_lock:
            if self._entries.get(request_id) is entry:
                del self._entries[request_id]
        if entry.error is not None:
            raise RuntimeError(f"generation of request {request_id!r} failed: {entry.error}") from entry.error
        assert entry.result is not None  # done is set only after result or error
        return entry.result

    def abort(self, request_id: str) -> bool:
        """Abort ``request_id``; see ``InferenceEngine.abort``. A running request that reaches EOS or
        ``max_new_tokens`` at the same step keeps that finish reason."""
        with self._state_lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.done.is_set():
                return False
            if entry.running:
                entry.abort_requested = True  # read by _AbortCriterion at the next token
            else:
                self._queue.remove(entry)
                self._finish(entry, result=GenerateResult(request_id, [], [], "abort"))
            return True

    # ----- batch generation, weights, memory -------------------------------------------------------

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample one response per row; exactly ``roll.strategies.hf_generate.generate``."""
        with self._model_lock:
            with self._state_lock:
                self._check_serving()
            torch.set_num_threads(self._num_threads)
            return hf_generate.generate(
                self._model, batch, params, self._eos_id, self._pad_id, self._tokenizer
            )

    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Copy tensors into the model's parameters and buffers by name (dtype and device converted).

        Names that are not given keep their values, so weights may arrive in buckets over several calls
        and tied weights may be left out. A Mapping is checked as a whole before anything is copied; an
        iterable of (name, tensor) pairs is copied as it streams and the bad names are reported at its end.

        Raises:
            ValueError: unknown names or mismatched shapes, all listed.
        """
        with self._model_lock:
            targets: dict[str, torch.Tensor] = dict(self._model.named_parameters(remove_duplicate=False))
            targets.update(self._model.named_buffers(remove_duplicate=False))
            if isinstance(named_tensors, Mapping):
                _copy_by_name(targets, named_tensors.items(), check_only=True)
                named_tensors = named_tensors.items()
            _copy_by_name(targets, named_tensors, check_only=False)

    def release_memory(self) -> dict[str, float]:
        """Move the weights to CPU after the running batch (0 bytes when the engine already runs on CPU);
        HF keeps no cache between ``generate`` calls, so the weights are all there is to free."""
        start = time.perf_counter()
        with self._model_lock:
            with self._state_lock:
                already = self._released
                self._released = True
            moved = 0 if already else _accelerator_bytes(self._model)
            if moved:
                self._model.to("cpu")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}

    def reacquire_memory(self) -> dict[str, float]:
        """Move the weights back to the engine's device and resume queued requests."""
        start = time.perf_counter()
        with self._model_lock:
            with self._state_lock:
                was_released = self._released
            moved = 0
            if was_released and self._device.type != "cpu":
                self._model.to(self._device)
                moved = _accelerator_bytes(self._model)
            with self._state_lock:
                self._released = False
                self._wakeup.notify_all()
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}

    def shutdown(self) -> None:
        """Abort queued and running requests and stop the background thread; see the base class."""
        with self._state_lock:
            self._closed = True
            for entry in self._queue:
                self._finish(entry, result=GenerateResult(entry.request.request_id, [], [], "abort"))
            self._queue.clear()
            for entry in self._entries.values():
                if entry.running:
                    entry.abort_requested = True
            self._wakeup.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ----- the background thread -------------------------------------------------------------------

    def _serve(self) -> None:
        """Run queued requests batch by batch until shutdown."""
        torch.set_num_threads(self._num_threads)
        while True:
            with self._wakeup:
                while not self._closed and (self._released or not self._queue):
                    self._wakeup.wait()
                if self._closed:
                    return
            with self._model_lock:
                # Taken under the model lock: a release that slipped in since the wait is seen here.
                with self._state_lock:
                    entries = [] if self._released else self._take_batch()
                if entries:
                    self._run(entries)

    def _take_batch(self) -> list[_Entry]:
        """Dequeue the oldest request and the queued ones sharing its params (caller holds the lock)."""
        params = self._queue[0].request.params
        chosen = [entry for entry in self._queue if entry.request.params == params]
        chosen = chosen[: self._max_batch_size]
        taken = {id(entry) for entry in chosen}
        self._queue = [entry for entry in self._queue if id(entry) not in taken]
        for entry in chosen:
            entry.running = True
        return chosen

    def _run(self, entries: list[_Entry]) -> None:
        """Generate for ``entries`` and publish each result (or the error, so no caller waits forever)."""
        try:
            results = self._generate_requests(entries)
        except Exception as error:  # noqa: BLE001 - handed to every awaiting caller
            with self._state_lock:
                for entry in entries:
                    self._finish(entry, error=error)
            return
        with self._state_lock:
            for entry, result in zip(entries, results):
                self._finish(entry, result=result)

    def _generate_requests(self, entries: list[_Entry]) -> list[GenerateResult]:
        requests = [entry.request for entry in entries]
        prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in requests], self._pad_id)
        criterion = _AbortCriterion(len(entries), prompt_ids.shape[1], lambda: self._abort_flags(entries))
        out = hf_generate.generate(
            self._model,
            Batch(tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}),
            requests[0].params,
            self._eos_id,
            self._pad_id,
            stopping_criteria=StoppingCriteriaList([criterion]),
        )
        lengths = out["response_mask"].sum(dim=1).tolist()
        max_new_tokens = requests[0].params.max_new_tokens
        results = []
        for row, request in enumerate(requests):
            length, reason = int(lengths[row]), out["finish_reason"][row]
            # Where the row would have ended anyway. "length" is not read from the mask: once every row
            # is stopped generate returns early, and a row cut by abort then looks like a full one.
            natural_end = length if reason == "stop" else max_new_tokens
            cut = criterion.stopped_at[row]
            # An abort counts only when it cut the response short; a row that reached EOS or
            # max_new_tokens first keeps its natural ending.
            if cut is not None and cut < natural_end:
                length, reason = cut, "abort"
            results.append(
                GenerateResult(
                    request_id=request.request_id,
                    token_ids=out["response_ids"][row, :length].tolist(),
                    logprobs=out["rollout_logprobs"][row, :length].tolist(),
                    finish_reason=reason,
                )
            )
        return results

    def _abort_flags(self, entries: list[_Entry]) -> list[bool]:
        with self._state_lock:
            return [entry.abort_requested for entry in entries]

    def _finish(
        self, entry: _Entry, result: GenerateResult | None = None, error: Exception | None = None
    ) -> None:
        """Publish an outcome and wake the awaiting caller (caller holds the state lock)."""
        entry.result, entry.error, entry.running = result, error, False
        entry.done.set()

    def _check_serving(self) -> None:
        """Raise unless new work is accepted (caller holds the state lock)."""
        if self._closed:
            raise RuntimeError("the inference engine is shut down")
        if self._released:
            raise RuntimeError(
                "the inference engine's memory is released (release_memory); call reacquire_memory first"
            )


def _copy_by_name(
    targets: dict[str, torch.Tensor], items: Iterable[tuple[str, torch.Tensor]], check_only: bool
) -> None:
    """Copy (name, tensor) pairs into ``targets`` (or only check them); raise listing every bad pair."""
    unknown: list[str] = []
    mismatched: list[str] = []
    with torch.no_grad():
        for name, tensor in items:
            target = targets.get(name)
            if target is None:
                unknown.append(name)
            elif target.shape != tensor.shape:
                mismatched.append(f"{name} {tuple(tensor.shape)} (model: {tuple(target.shape)})")
            elif not check_only:
                target.copy_(tensor)
    if unknown or mismatched:
        problems = []
        if unknown:
            problems.append(f"unknown names {unknown}")
        if mismatched:
            problems.append(f"mismatched shapes {mismatched}")
        raise ValueError(f"weights do not match the inference model: {'; '.join(problems)}")
