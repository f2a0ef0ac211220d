"""``HFEngine``: a continuous-batching decode loop over a Hugging Face causal LM (CPU, tests, small GPUs).

One background thread owns the model and runs decode steps. Between two steps it admits queued
requests (up to ``max_running_requests`` rows in flight): their prompts are prefilled together and
their rows join the running batch, whose KV cache (``SlotCache``) keeps every row left-padded to a
common length. A row that ends (EOS, ``max_new_tokens``, abort) leaves the batch at once and its
result is published at that step, not when the whole batch ends. Only the sampled token's logprob is
kept per step, so memory is bounded by the KV cache and one [rows, vocab] logits tensor, whatever the
vocabulary and response length.

A request with a ``cache_key`` (an episode id) leaves its KV in a prefix store when it ends by its
tokens (``roll.strategies.infer.prefix_store``); the next request of that key whose prompt extends it
prefills only the new tokens. The store is bounded (``prefix_cache_tokens``) and emptied whenever the
weights change, so no turn reads KV computed by older weights than its own first token.

Batch generation (``generate``) submits every row as a request and waits for all of them, so both
paths run the same code. ``roll.strategies.hf_generate`` (Hugging Face ``generate``) is the independent
reference the tests hold this engine to.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from roll.data.batch import Batch
from roll.data.images import IMAGES, VisionInputs
from roll.data.padding import left_pad, position_ids_from_mask
from roll.models.loading import end_of_sequence_ids
from roll.strategies.cpu_threads import decode_threads
from roll.strategies.infer.adapter_merge import AdapterMerger
from roll.strategies.infer.base import InferenceEngine, NamedTensors, copy_by_name
from roll.strategies.infer.kv_cache import SlotCache
from roll.strategies.infer.prefix_store import DEFAULT_PREFIX_CACHE_TOKENS, PrefixStore, StoredPrefix
from roll.strategies.infer.requests_held import INTERNAL_ID_PREFIX, RequestsHeld, results_as_batch
from roll.strategies.offload import HostBuffers
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams, stop_string_end
from roll.strategies.sampling import sample_tokens
from roll.strategies.vision import (
    check_images_given,
    mrope_positions,
    placeholder_ids,
    vision_arguments,
    without_placeholders,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["HFEngine"]

_BATCH_ID_PREFIX = f"{INTERNAL_ID_PREFIX}batch"  # ids of the requests ``generate`` makes


@dataclass
class _Entry:
    """One submitted request and what became of it; fields are guarded by the engine's state lock."""

    request: GenerateRequest
    done: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    abort_requested: bool = False
    keep_prefix: bool = True  # cleared by release_prefixes: the episode ended, keep nothing of this request
    result: GenerateResult | None = None
    error: Exception | None = None


@dataclass
class _Row:
    """A running request's row in the decode batch; touched by the serving thread only."""

    entry: _Entry
    next_position: int  # position id of the token fed at the next decode step
    weights_epoch: int  # the engine's _weights_epoch at prefill: its KV is homogeneous while it is unchanged
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _accelerator_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers that live off the CPU (tied tensors counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")


def _cache_argument(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes its KV cache by: ``cache`` since transformers 5.x renamed it
    (``past_key_values`` warns there, and goes in 5.40), ``past_key_values`` before."""
    from roll.strategies.hf_forward import forward_takes

    return "cache" if forward_takes(model, "cache") else "past_key_values"


class HFEngine(RequestsHeld, InferenceEngine):
    """Serves ``model`` with continuous batching: batch generation and single requests.

    Args:
        model: a causal LM whose forward takes a KV cache (``cache``, or ``past_key_values`` before
            transformers renamed it) and ``logits_to_keep`` (every Hugging Face decoder does); moved to
            ``device`` and put in eval mode.
        tokenizer: with the model's generation config, gives the end-of-sequence ids (every one of
            them ends a response, see ``end_of_sequence_ids``) and the pad id (falling back to the
            first EOS); decodes ``response_text``.
        device: where the model runs; default: where its parameters are now.
        max_running_requests: most rows decoding at once (None: no limit); further requests queue and
            join as rows finish. Bounds the KV cache.
        prefix_cache_tokens: most tokens of KV kept between the requests of a ``cache_key`` (all keys
            together; the least recently stored entry is evicted first); 0 keeps none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device | str | None = None,
        max_running_requests: int | None = None,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
    ) -> None:
        if max_running_requests is not None and max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1 or None, got {max_running_requests}")
        self._prefixes = PrefixStore(prefix_cache_tokens)
        self._adapter = AdapterMerger()
        self._updating = False  # inside weight_update: adapter halves wait for its end to be merged
        self._device = torch.device(device) if device is not None else next(model.parameters()).device
        if self._device.type == "cuda":
            # cuDNN's attention (SDPA picks it for bf16/fp16) builds an execution plan for every new shape,
            # and every decode step has a new KV length, so with it decoding spends its time planning,
            # several times slower than without (docs/gpu.md).
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._model = model.to(self._device).eval()
        self._cache_argument = _cache_argument(model)
        self._tokenizer = tokenizer
        eos_ids = end_of_sequence_ids(tokenizer, model)
        self._eos_ids = frozenset(eos_ids)
        self._pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self._unsampled = placeholder_ids(model)  # a VLM's image tokens: never sampled (the trainer agrees)
        self._capacity = max_running_requests
        # torch's CPU thread count is per calling thread: the serving thread takes the count the
        # constructing thread was given (one for a narrow model on the CPU: roll.strategies.cpu_threads).
        self._num_threads = decode_threads(model, self._device, torch.get_num_threads())
        # Lock order: _model_lock before _state_lock, never the reverse. _model_lock is held for every
        # use of the model (one decode step, weight copies, device moves), so weights change only
        # between steps; _state_lock guards the request book-keeping and is only held briefly.
        self._model_lock = threading.RLock()  # re-entered by load_weights inside weight_update
        self._hold_requests()  # _state_lock, _entries, the line of finished ids, _closed
        self._wakeup = threading.Condition(self._state_lock)
        self._queue: list[_Entry] = []
        self._released = False
        self._host_buffers = HostBuffers()  # where the weights wait while a colocated trainer has the device
        self._model_waiters = 0  # callers waiting for the model lock; the decode loop yields to them
        self._weights_version = -1
        # Bumped at every weight change (with or without a version), under the model lock: a row whose KV
        # spans two epochs is not stored, and the store is emptied, so kept KV always matches the weights.
        self._weights_epoch = 0
        self._batch_ids = itertools.count()
        # The decode batch, owned by the serving thread: rows in cache order, their cache, attention
        # mask [rows, columns] and the last sampled token of each row (the next step's input).
        self._rows: list[_Row] = []
        self._cache = SlotCache()
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=self._device)
        self._thread = threading.Thread(target=self._serve, name="hf-inference-engine", daemon=True)
        self._thread.start()

    @property
    def model(self) -> torch.nn.Module:
        """The served model (the rollout worker scores with it too: ``compute_logprobs``)."""
        return self._model

    # ----- single requests -------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> None:
        """Queue ``request``; see ``InferenceEngine.submit``."""
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"submit takes a GenerateRequest, got {type(request).__name__}")
        self._enqueue([request])

    def submit_many(self, requests: Sequence[GenerateRequest]) -> None:
        """Queue ``requests`` as one group (all ids checked before any is queued), so the serving thread
        admits them at the same step; see ``InferenceEngine.submit_many``."""
        requests = list(requests)
        for request in requests:
            if not isinstance(request, GenerateRequest):
                raise TypeError(f"submit_many takes GenerateRequests, got a {type(request).__name__}")
        self._enqueue(requests)

    def abort(self, request_id: str) -> bool:
        """Abort ``request_id``; see ``InferenceEngine.abort``. A running request keeps the token of the
        step in progress; one that reaches EOS or ``max_new_tokens`` at that step keeps that ending."""
        with self._state_lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.done.is_set():
                return False
            if entry.running:
                entry.abort_requested = True  # read by the serving thread after the step in progress
            else:
                self._queue.remove(entry)
                self._finish(entry, result=GenerateResult(request_id, [], [], "abort"))
            return True

    # ----- batch generation, weights, memory -------------------------------------------------------

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample one response per row of ``batch``; the contract of ``roll.strategies.hf_generate``."""
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].bool()
        tag = f"{_BATCH_ID_PREFIX}{next(self._batch_ids)}-"
        images = batch[IMAGES] if IMAGES in batch else [None] * len(batch)
        requests = [
            GenerateRequest(
                f"{tag}{row}", prompt_ids[row][prompt_mask[row]].tolist(), params, vision=images[row]
            )
            for row in range(prompt_ids.shape[0])
        ]
        self._enqueue(requests)
        results = []
        try:
            for request in requests:
                results.append(self.await_result(request.request_id, None))
        except BaseException:
            for request in requests[len(results) :]:  # leave no orphaned rows behind a failed batch
                self.abort(request.request_id)
            raise
        return self._as_batch(results, params.max_new_tokens)

    def load_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Copy tensors into the model's parameters and buffers by name (dtype and device converted),
        between two decode steps. Rows in flight go on with the new weights; ``version`` (when given)
        is recorded with every token sampled from then on.

        Names that are not given keep their values, so weights may arrive in buckets over several calls
        and tied weights may be left out. A Mapping is checked as a whole before anything is copied; an
        iterable of (name, tensor) pairs is copied as it streams and the bad names are reported at its end.

        Raises:
            ValueError: unknown names or mismatched shapes, all listed.
        """
        with self._between_steps():
            targets: dict[str, torch.Tensor] = dict(self._model.named_parameters(remove_duplicate=False))
            targets.update(self._model.named_buffers(remove_duplicate=False))
            if isinstance(named_tensors, Mapping):
                copy_by_name(targets, named_tensors.items(), check_only=True)
                named_tensors = named_tensors.items()
            try:
                copy_by_name(targets, named_tensors, check_only=False)
            finally:  # a stream that failed half way has changed weights all the same
                self._new_weights()
            if version is not None:
                self._weights_version = version

    loads_adapters = True

    def load_adapter(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Merge a LoRA adapter into the weights (``AdapterMerger``: base copies of the adapted layers in
        host memory, ``W_base + B A`` written into the live layers); see the base class."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        with self._between_steps():
            self._adapter.receive(items)
            if self._updating:
                return  # merged when the weight update ends: a layer's halves may be in two buckets
            try:
                self._adapter.apply(self._model)
            finally:
                self._new_weights()
            if version is not None:
                self._weights_version = version

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Score whole sequences in one forward pass between two decode steps; see the base class."""
        from roll.strategies.cpu_threads import threads_for_decoding
        from roll.strategies.hf_forward import sequence_logprobs

        # As few tokens as a decode step: the decode loop's thread count, so a narrow model's forward does
        # not wake a second OpenMP thread in this process while the trainer computes.
        with self._between_steps(), threads_for_decoding(self._model, self._device):
            return sequence_logprobs(self._model, [list(ids) for ids in token_ids], self._pad_id)

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[None]:
        """Hold the model between two decode steps while buckets are loaded; see the base class. An
        adapter that arrived in the buckets is merged at the end, once all of it is in."""
        with self._between_steps():
            self._updating = True
            try:
                yield
                if self._adapter.pending:
                    self._adapter.apply(self._model)
            finally:
                self._updating = False
                self._adapter.discard()
                self._new_weights()
            self._weights_version = version

    def release_prefixes(self, cache_keys: Iterable[str]) -> int:
        """Free the KV kept for ``cache_keys`` now (their episodes ended); see the base class."""
        keys = set(cache_keys)
        with self._state_lock:
            # A turn still in flight (an episode ended by an abort) must not store its KV afterwards.
            for entry in self._entries.values():
                if not entry.done.is_set() and entry.request.cache_key in keys:
                    entry.keep_prefix = False
            return self._prefixes.release(keys)

    def prefix_stats(self) -> dict[str, int]:
        """Prefill tokens computed and reused, hits, misses, evictions since the start, and the entries
        and tokens held now (``PrefixStore.stats``): with reuse, a turn adds only its new tokens."""
        return self._prefixes.stats()

    def release_memory(self) -> dict[str, float]:
        """Move the weights to CPU after the step in progress (0 bytes when the engine runs on CPU).
        Rows in flight pause and keep their KV cache; release between stages, when none are running."""
        start = time.perf_counter()
        with self._between_steps():
            with self._state_lock:
                already = self._released
                self._released = True
            moved = 0 if already else _accelerator_bytes(self._model)
            self._prefixes.clear()
            if moved:
                self._host_buffers.offload(self._model)
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}

    def reacquire_memory(self) -> dict[str, float]:
        """Move the weights back to the engine's device and resume queued requests."""
        start = time.perf_counter()
        with self._between_steps():
            with self._state_lock:
                was_released = self._released
            moved = 0
            if was_released and self._device.type != "cpu":
                self._host_buffers.reload(self._model, self._device)
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
            self._finished_ready.notify_all()  # a waiting collect_finished returns instead of timing out
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._prefixes.clear()

    # ----- the serving thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        """Admit, step and retire rows until shutdown."""
        torch.set_num_threads(self._num_threads)
        while True:
            with self._wakeup:
                while self._nothing_to_do():
                    self._wakeup.wait()
            with self._model_lock:
                # Admission happens under the model lock: a release that slipped in is seen here.
                with self._state_lock:
                    if self._released and not self._closed:
                        continue
                    admitted = self._admit()
                if not admitted and not self._rows:
                    if self._closed:
                        return
                    continue
                try:
                    self._step(admitted)
                except Exception as error:  # noqa: BLE001 - handed to every awaiting caller
                    self._fail_all(admitted, error)

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the model between two decode steps. The loop would otherwise take the lock straight
        back after each step (locks are not fair) and a weight update could wait for a whole batch."""
        with self._state_lock:
            self._model_waiters += 1
        try:
            with self._model_lock:
                yield
        finally:
            with self._state_lock:
                self._model_waiters -= 1
                self._wakeup.notify_all()

    def _nothing_to_do(self) -> bool:
        """No request to serve, memory released, or someone waiting for the model (caller holds the
        state lock)."""
        if self._model_waiters:
            return True
        if self._closed:
            return False
        return self._released or not (self._queue or self._rows)

    def _admit(self) -> list[_Entry]:
        """Take queued requests up to the free slots (caller holds the state lock)."""
        free = len(self._queue) if self._capacity is None else max(self._capacity - len(self._rows), 0)
        admitted, self._queue = self._queue[:free], self._queue[free:]
        for entry in admitted:
            entry.running = True
        return admitted

    @torch.no_grad()  # grad mode is per thread; not inference_mode: weights are copied in place later
    def _step(self, admitted: list[_Entry]) -> None:
        """One decode step for the running rows, then the prefill of the admitted ones, then retire the
        rows that ended."""
        if self._rows:
            self._decode()
        if admitted:
            self._prefill(admitted)
        self._retire()

    def _decode(self) -> None:
        self._mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=1)
        positions = torch.tensor([[row.next_position] for row in self._rows], device=self._device)
        for row in self._rows:
            row.next_position += 1
        logits = self._model(
            input_ids=self._last_tokens.unsqueeze(1),
            attention_mask=self._mask,
            position_ids=positions,
            **{self._cache_argument: self._cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        self._last_tokens = self._sample(logits, self._rows)

    def _prefill(self, admitted: list[_Entry]) -> None:
        """Run the admitted prompts, each from the KV kept for its cache key where there is some.

        Row i's columns: its kept part right-aligned in the first ``past`` columns, then its new tokens
        left-padded in the last ``new`` columns, all masked but the real ones; positions go on from the
        kept length, so a row computes what a prefill of its whole prompt would."""
        taken = [
            # An image prompt is prefilled whole: its kept KV would hold image tokens of another request.
            (0, None)
            if entry.request.vision is not None
            else self._prefixes.take(entry.request.cache_key, entry.request.prompt_ids)
            for entry in admitted
        ]
        reused = [length for length, _ in taken]
        prompts = [entry.request.prompt_ids[length:] for entry, length in zip(admitted, reused)]
        ids, new_mask = left_pad(prompts, self._pad_id)
        lengths = torch.tensor(reused).unsqueeze(1)
        past = max(reused)
        past_mask = (torch.arange(past) >= past - lengths).long()
        positions = lengths + position_ids_from_mask(new_mask)
        mask = torch.cat([past_mask, new_mask], dim=1).to(self._device)
        layers = [states for _, states in taken]
        cache = SlotCache.from_prefixes(layers, room=ids.shape[1]) if past else SlotCache()
        self._prefixes.count_prefill(computed=sum(map(len, prompts)), reused=sum(reused))
        ids, positions = ids.to(self._device), positions.to(self._device)
        images, offsets = {}, torch.zeros(len(admitted), dtype=torch.long)
        vision = VisionInputs.concat([entry.request.vision for entry in admitted])
        check_images_given(self._model, ids, vision)
        if vision is not None:
            # Image prompts have none kept (above): positions, pixel values and grids as the trainer has them.
            images = vision_arguments(self._model, vision, self._device)
            image_positions, offsets = mrope_positions(self._model, ids, mask[:, past:], vision)
            has_image = torch.tensor(
                [entry.request.vision is not None for entry in admitted], device=ids.device
            )
            positions = torch.where(has_image[None, :, None], image_positions, positions.expand(3, -1, -1))
        logits = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **images,
            **{self._cache_argument: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        rows = [
            # After an image the text positions run ahead of the token count by the row's offset.
            _Row(
                entry,
                next_position=len(entry.request.prompt_ids) + int(offset),
                weights_epoch=self._weights_epoch,
            )
            for entry, offset in zip(admitted, offsets)
        ]
        tokens = self._sample(logits, rows)
        if self._rows:
            self._cache.append_rows(cache)
            width = max(self._mask.shape[1], mask.shape[1])
            self._mask = torch.cat([_left_pad_columns(self._mask, width), _left_pad_columns(mask, width)])
            self._last_tokens = torch.cat([self._last_tokens, tokens])
        else:
            self._cache, self._mask, self._last_tokens = cache, mask, tokens
        self._rows.extend(rows)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Sample each row's next token with its request's params; record token, logprob and version."""
        logits = without_placeholders(logits, self._unsampled)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        logprobs = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
        groups: dict[SamplingParams, list[int]] = {}
        for index, row in enumerate(rows):
            groups.setdefault(row.entry.request.params, []).append(index)
        for params, indices in groups.items():
            if len(indices) == len(rows):
                tokens, logprobs = sample_tokens(logits, params)
            else:
                where = torch.tensor(indices, device=logits.device)
                tokens[where], logprobs[where] = sample_tokens(logits[where], params)
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(self._weights_version)
        return tokens

    def _retire(self) -> None:
        """Publish the rows that ended at this step and drop them from the batch."""
        keep: list[int] = []
        # Copied before the results are published: the next turn of an episode is admitted after this
        # step at the earliest and finds its prefix, and an episode's release cannot come before it.
        prefixes = self._prefixes_of_ending_rows()
        with self._state_lock:
            for index, row in enumerate(self._rows):
                reason = self._finish_reason(row, row.entry.abort_requested)
                if reason is None:
                    keep.append(index)
                    continue
                prefix = prefixes.get(index)
                if prefix is not None and row.entry.keep_prefix and not self._closed:
                    assert row.entry.request.cache_key is not None
                    self._prefixes.put(row.entry.request.cache_key, prefix)
                request_id = row.entry.request.request_id
                result = GenerateResult(request_id, row.tokens, row.logprobs, reason, row.versions)
                self._finish(row.entry, result=result)
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._reset_batch()
            return
        rows = torch.tensor(keep, device=self._device)
        mask = self._mask[rows]
        first = int((mask.sum(dim=0) > 0).nonzero()[0])  # left-padding columns no kept row needs
        self._cache.keep(rows, first)
        self._mask, self._last_tokens = mask[:, first:], self._last_tokens[rows]

    def _prefixes_of_ending_rows(self) -> dict[int, StoredPrefix]:
        """The KV to keep of each row with a cache key that ends by its tokens at this step (not by an
        abort, which ends the episode) and whose KV all comes from the current weights, by row index.

        A row's real columns hold its prompt and every sampled token but the last, which was never fed."""
        prefixes: dict[int, StoredPrefix] = {}
        for index, row in enumerate(self._rows):
            request = row.entry.request
            if (
                request.cache_key is None
                or row.weights_epoch != self._weights_epoch
                or not self._prefixes.fits(len(request.prompt_ids) + len(row.tokens) - 1)
                or self._finish_reason(row, abort=False) is None
            ):
                continue
            token_ids = request.prompt_ids + tuple(row.tokens[:-1])
            layers = self._cache.row_states(index, self._mask[index].bool())
            if layers and layers[0][0].shape[-2] != len(token_ids):
                raise RuntimeError(
                    f"request {request.request_id!r} has {layers[0][0].shape[-2]} cached columns for "
                    f"{len(token_ids)} tokens: the decode batch's mask and cache disagree"
                )
            prefixes[index] = StoredPrefix(token_ids, layers)
        return prefixes

    def _finish_reason(self, row: _Row, abort: bool) -> str | None:
        params = row.entry.request.params
        if row.tokens[-1] in self._eos_ids or row.tokens[-1] in params.stop_token_ids:
            return "stop"
        if params.stop and stop_string_end(self._tokenizer, row.tokens, 1, params.stop) is not None:
            return "stop"
        if len(row.tokens) >= params.max_new_tokens:
            return "length"
        return "abort" if abort else None

    def _fail_all(self, admitted: list[_Entry], error: Exception) -> None:
        """A failed step fails every row in it (the batch's cache is no longer consistent)."""
        running = {id(row.entry) for row in self._rows}
        entries = [row.entry for row in self._rows] + [e for e in admitted if id(e) not in running]
        with self._state_lock:
            for entry in entries:
                if not entry.done.is_set():  # a row published before the failure keeps its result
                    self._finish(entry, error=error)
        self._reset_batch()

    def _new_weights(self) -> None:
        """The weights changed (caller holds the model lock): kept KV is stale."""
        self._weights_epoch += 1
        self._prefixes.clear()

    def _reset_batch(self) -> None:
        self._rows = []
        self._cache = SlotCache()
        self._mask = self._mask.new_zeros((0, 0))
        self._last_tokens = self._last_tokens.new_zeros(0)

    def _enqueue(self, requests: list[GenerateRequest]) -> None:
        """Queue ``requests`` together, so that they are admitted at the same step when slots allow."""
        with self._state_lock:
            self._check_serving()
            self._check_new_ids(requests)
            for request in requests:
                entry = _Entry(request)
                self._entries[request.request_id] = entry
                self._queue.append(entry)
            self._wakeup.notify()

    def _finish(
        self, entry: _Entry, result: GenerateResult | None = None, error: Exception | None = None
    ) -> None:
        """Publish an outcome and wake the awaiting caller (caller holds the state lock)."""
        entry.result, entry.error, entry.running = result, error, False
        self._published(entry)

    def _check_serving(self) -> None:
        """Raise unless new work is accepted (caller holds the state lock)."""
        if self._closed:
            raise RuntimeError("the inference engine is shut down")
        if self._released:
            raise RuntimeError(
                "the inference engine's memory is released (release_memory); call reacquire_memory first"
            )

    def _as_batch(self, results: list[GenerateResult], max_new_tokens: int) -> Batch:
        return results_as_batch(results, max_new_tokens, self._pad_id, self._tokenizer)


def _left_pad_columns(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return torch.nn.functional.pad(mask, (missing, 0)) if missing else mask
