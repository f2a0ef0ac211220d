"""The inference-engine contract: single requests (submit / await / abort) and batch generation.

The rollout worker talks to an engine only through ``InferenceEngine``, so the Hugging Face engine
used on CPU and in tests and the fast GPU engines plug in the same way.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from roll.data.batch import Batch
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams
from roll.utils.registry import Registry

__all__ = [
    "INFERENCE_ENGINES",
    "copy_by_name",
    "InferenceEngine",
    "NamedTensors",
]

# A whole state dict, or (name, tensor) pairs streamed bucket by bucket from the trainer.
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class InferenceEngine(abc.ABC):
    """An LLM inference engine as the rollout worker sees it.

    Two ways in: ``generate`` runs a whole left-padded batch at once (synchronous rollout), and
    ``submit`` / ``await_result`` / ``abort`` handle single requests (asynchronous and partial rollout,
    dynamic sampling that stops once enough samples are in). A scheduler driving many requests uses
    ``submit_many`` (a group of samples of one prompt starts together) and ``collect_finished``
    (whatever finished, in one call, instead of one blocking ``await_result`` per request). The
    contract is drawn so that vLLM's and SGLang's engines (``add_request`` / ``abort``) fit it.
    ``HFEngine`` (``roll.strategies.infer.hf``, continuous batching over any Hugging Face causal LM) and
    ``VLLMEngine`` (``roll.strategies.infer.vllm``, vLLM stepped in the worker's process) implement it.

    Rules every engine keeps:
      - The single-request methods may be called from any thread, also while a generation runs (the
        rollout worker is a threaded actor, so an abort arrives mid-generation).
      - Results are delivered exactly once: ``await_result`` or ``collect_finished``, whichever comes
        first, hands a finished result over and forgets it.
      - While memory is released (``release_memory``), ``generate`` and ``submit`` raise RuntimeError;
        requests submitted before the release wait until ``reacquire_memory``.
      - Weights loaded with ``load_weights`` never change in the middle of a decode step; requests in
        flight go on with the new weights, and each token records the version that sampled it.
    """

    @abc.abstractmethod
    def submit(self, request: GenerateRequest) -> None:
        """Queue ``request`` and return at once.

        Raises:
            ValueError: its request id is already in use by an unfinished or uncollected request.
            RuntimeError: memory is released or the engine is shut down.
        """

    def submit_many(self, requests: Sequence[GenerateRequest]) -> None:
        """Queue ``requests`` together, so that they start at the same decode step when slots allow (the
        samples of one prompt share their prefill instead of trickling in one step apart).

        This default submits them one by one, so an engine that cannot queue a group atomically still
        works, only without the common start, and a bad id leaves the requests before it queued.
        Engines that can should override it and check every id before queuing any.

        Raises:
            ValueError: an id is already in use or repeated.
            RuntimeError: memory is released or the engine is shut down.
        """
        for request in requests:
            self.submit(request)

    @abc.abstractmethod
    def collect_finished(self, timeout_s: float) -> list[GenerateResult]:
        """Block until a request submitted with ``submit`` / ``submit_many`` has finished and not been
        handed over yet, then hand over every such result at once, in finish order (aborted ones
        included, with finish_reason "abort"). A scheduler thus waits on one call per engine, whatever
        the number of requests in flight. Rows of ``generate`` are never returned here.

        Returns:
            The finished results, each delivered once (a later ``await_result`` of its id raises
            KeyError); [] when none finished within ``timeout_s``. Shutdown ends the wait: a shut-down
            engine returns what has finished, possibly [], without waiting.

        Raises:
            RuntimeError: a collected request's generation failed (the message names it, the cause is
                chained); it is forgotten, the other finished results stay for the next call.
        """

    @abc.abstractmethod
    def await_result(self, request_id: str, timeout_s: float | None) -> GenerateResult:
        """Block until ``request_id`` finishes and return its result (``None`` waits without limit).

        Raises:
            TimeoutError: not finished within ``timeout_s`` seconds (the message names the request);
                the request keeps running and can be awaited again.
            KeyError: the id was never submitted or its result was already collected.
            RuntimeError: the generation that ran the request failed (the cause is chained).
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Stop ``request_id``: a queued request finishes at once with no tokens, a running one at its
        next token with the tokens so far; both with finish_reason "abort".

        Returns:
            True if the request was queued or running, False for an unknown or already finished id.
        """

    @abc.abstractmethod
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample one response per row of ``batch``; the same contract (inputs, output fields and their
        meaning) as ``roll.strategies.hf_generate.generate``."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Copy ``named_tensors`` into the live model by name, between two decode steps (never inside
        one); ``version``, when given, labels the tokens sampled from then on (``weight_versions``).

        Tied weights (e.g. an LM head tied to the embedding) may be absent.

        Raises:
            ValueError: names the model does not have (all of them listed) or shapes that differ.
        """

    # Whether ``load_adapter`` works: a LoRA trainer then sends only the adapter (``roll.strategies.lora``),
    # and merged whole weights to an engine without it.
    loads_adapters: bool = False

    def load_adapter(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Take a LoRA adapter (``<layer>.lora_A`` [r, in], ``<layer>.lora_B`` [out, r] with alpha / r
        folded into B) and serve ``W_base + B A`` on each of those layers from then on; inside
        ``weight_update`` the halves may arrive over several calls and take effect when it ends.

        Raises:
            NotImplementedError: this engine takes whole weights only (``loads_adapters`` is False).
            ValueError: layers the model lacks, halves missing, shapes that do not fit.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot load a LoRA adapter; send merged weights")

    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each token's log-probability (temperature 1) given the tokens before it, for every token of
        each sequence but its first, under the weights served now: the weight-sync probe compares them
        with the trainer's.

        Raises:
            NotImplementedError: this engine cannot score tokens (set rollout.sync_probe_sequences=0).
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot score prompt tokens; set rollout.sync_probe_sequences=0"
        )

    @abc.abstractmethod
    def weight_update(self, version: int) -> contextlib.AbstractContextManager[None]:
        """A context in which no decode step runs, for weights that arrive in several
        ``load_weights`` calls (buckets); tokens sampled after it carry ``version``."""

    @abc.abstractmethod
    def release_memory(self) -> dict[str, float]:
        """Free the weights (and any cache) from the accelerator, e.g. while the trainer shares it.

        Returns:
            {"bytes": bytes moved off the accelerator, "seconds": time taken}; 0 bytes on CPU.
        """

    @abc.abstractmethod
    def reacquire_memory(self) -> dict[str, float]:
        """Undo ``release_memory``: weights back on the accelerator and requests served again.

        Returns:
            {"bytes": bytes moved onto the accelerator, "seconds": time taken}; 0 bytes on CPU.
        """

    def release_prefixes(self, cache_keys: Iterable[str]) -> int:
        """Forget the KV kept for ``cache_keys`` (their episodes ended), at once; requests of those keys
        still queued or running keep nothing when they end. This default keeps nothing to forget.

        Returns:
            How many kept prefixes were freed.
        """
        return 0

    def prefix_stats(self) -> dict[str, int]:
        """Counters of prefix reuse since the engine started (see ``HFEngine.prefix_stats``); {} for an
        engine without any."""
        return {}

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Abort every unfinished request and stop background work; idempotent. Afterwards ``submit``
        raises RuntimeError, results already finished can still be awaited."""


# Name -> factory building an engine. Factories import their backend inside, so an optional engine
# (vLLM, SGLang) costs nothing until chosen and can fail with a message naming the extra to install.
INFERENCE_ENGINES: Registry[Callable[..., InferenceEngine]] = Registry("inference engine")


def copy_by_name(
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
