"""Rollout worker: one data-parallel inference engine, chosen by name (``rollout.engine``: ``hf`` or
``vllm``, both behind the ``InferenceEngine`` contract) and built from the worker's spec. Batch
generation, single requests with abort, and new weights from the trainer over the weight-transfer group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch
from roll.distributed.sync_probe import score_after_transfer
from roll.distributed.worker import register
from roll.strategies.infer import INFERENCE_ENGINES, InferenceEngine
from roll.strategies.infer.prefix_store import DEFAULT_PREFIX_CACHE_TOKENS
from roll.strategies.lora import ADAPTER, FULL, PAYLOADS
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams
from roll.workers.base import ModelSpec, ModelWorker

# Single requests go to one worker, so they are plain methods that the router or the rollout scheduler
# calls on one rank (``Cluster.call_rank``); a registered Cluster call would reach every rank.
REQUEST_METHODS = (
    "submit",
    "submit_many",
    "await_result",
    "collect_finished",
    "abort",
    "abort_many",
    "release_prefixes",
    "prefix_stats",
)
# The label of the weights a worker starts with: the trainer's first sync is version 1, so every token
# of a run carries a version, and staleness is measured from the start.
INITIAL_WEIGHTS_VERSION = 0


@dataclass
class RolloutSpec:
    """What a rollout worker needs to start; fields named as in the ``rollout`` config section."""

    model: ModelSpec
    engine: str = "hf"
    max_running_requests: int | None = None
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS
    engine_options: dict[str, Any] = field(default_factory=dict)  # the engine's own (rollout.vllm)


class RolloutWorker(ModelWorker):
    """``config`` is a RolloutSpec (or anything with a ``model`` ModelSpec). Single requests, aborts and
    shutdown run in their own threads (the ``control`` group): they must reach the engine while a
    generation is in progress (the engine serialises its own model use). Generation and weight loading
    share the actor's one main thread; the engine decodes in its own serving thread."""

    concurrency_groups = {"control": 8}
    weights_version: int  # the version of the engine's weights, INITIAL_WEIGHTS_VERSION after setup
    engine: InferenceEngine

    @register(Dispatch.ONE_TO_ALL)
    def setup(self, **kwargs: object) -> None:
        self.set_up_process()
        spec = self.config if isinstance(self.config, RolloutSpec) else RolloutSpec(self.config.model)
        # The engine loads the model itself (vLLM from the directory, the hf engine through transformers).
        self.engine = INFERENCE_ENGINES.get(spec.engine)(spec, self.tokenizer, self.device)
        self.model = getattr(self.engine, "model", None)  # the hf engine's, for compute_logprobs
        with self.engine.weight_update(INITIAL_WEIGHTS_VERSION):  # labels tokens sampled before any sync
            pass
        self.weights_version = INITIAL_WEIGHTS_VERSION
        self.weight_group = None
        self.weight_payload = FULL  # what the trainer sends (set_weight_payload): full, merged or adapter
        self.probe_sequences: list[list[int]] | None = None  # scored after every sync (set_sync_probe)

    @register(Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group="control")
    def shutdown(self) -> None:
        from roll.distributed.collective import destroy_group

        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
        if getattr(self, "weight_group", None) is not None:
            destroy_group(self.weight_group)
            self.weight_group = None

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """One response per prompt row of this worker's shard (see ``roll.strategies.hf_generate``)."""
        return self.engine.generate(batch, params)

    # ------------------------------------------------------------ single requests (the router's path)
    @ray.method(concurrency_group="control")
    def submit(self, request: GenerateRequest) -> None:
        self.engine.submit(request)

    @ray.method(concurrency_group="control")
    def submit_many(self, requests: list[GenerateRequest]) -> None:
        """Queue a group (e.g. the samples of one prompt) in one call, to start at the same step."""
        self.engine.submit_many(requests)

    @ray.method(concurrency_group="control")
    def await_result(self, request_id: str, timeout_s: float | None = None) -> GenerateResult:
        return self.engine.await_result(request_id, timeout_s)

    @ray.method(concurrency_group="control")
    def collect_finished(self, timeout_s: float) -> list[GenerateResult]:
        """Every result finished since the last collection, waiting up to ``timeout_s`` for one: a
        scheduler keeps one such call in flight per worker instead of one per request. It holds one
        ``control`` thread while it waits, so keep ``timeout_s`` short next to the call timeout."""
        return self.engine.collect_finished(timeout_s)

    @ray.method(concurrency_group="control")
    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    @ray.method(concurrency_group="control")
    def abort_many(self, request_ids: list[str]) -> list[bool]:
        """Abort several requests in one call (e.g. a group that is no longer needed); per id, whether
        it was still queued or running (see ``InferenceEngine.abort``)."""
        return [self.engine.abort(request_id) for request_id in request_ids]

    @ray.method(concurrency_group="control")
    def release_prefixes(self, cache_keys: list[str]) -> int:
        """Free the KV the engine keeps for ``cache_keys`` (episodes that ended); how many were held."""
        return self.engine.release_prefixes(cache_keys)

    @ray.method(concurrency_group="control")
    def prefix_stats(self) -> dict[str, int]:
        """The engine's prefix-reuse counters (``HFEngine.prefix_stats``): prefill tokens computed and
        reused, hits, misses, evictions, entries and tokens held."""
        return self.engine.prefix_stats()

    # ------------------------------------------------------------ memory between colocated stages
    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self) -> dict[str, float]:
        """Release the engine's weights and cache from the device (a colocated trainer needs it)."""
        return self.engine.release_memory()

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self) -> dict[str, float]:
        return self.engine.reacquire_memory()

    # ------------------------------------------------------------ weights
    @register(Dispatch.ONE_TO_ALL)
    def loads_adapters(self) -> bool:
        """Whether the engine merges a LoRA adapter itself (then only the adapter is sent to it)."""
        return self.engine.loads_adapters

    @register(Dispatch.ONE_TO_ALL)
    def set_weight_payload(self, payload: str) -> None:
        """What later transfers carry (``roll.strategies.lora.PAYLOADS``): whole weights (``full``,
        ``merged``) are copied in by name, an ``adapter`` is merged by the engine."""
        if payload not in PAYLOADS:
            raise ValueError(f"unknown weight payload {payload!r}; expected one of {', '.join(PAYLOADS)}")
        self.weight_payload = payload

    def _load_bucket(self, named_tensors: dict[str, torch.Tensor]) -> None:
        if self.weight_payload == ADAPTER:
            self.engine.load_adapter(named_tensors)
        else:
            self.engine.load_weights(named_tensors)

    @register(Dispatch.ONE_TO_ALL)
    def set_sync_probe(self, sequences: list[list[int]] | None) -> None:
        """Score ``sequences`` after every sync, before answering it (``roll.distributed.sync_probe``)."""
        self.probe_sequences = sequences

    @register(Dispatch.ONE_TO_ALL)
    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """The engine's logprobs of each token after the first of each sequence (the sync probe)."""
        return self.engine.prompt_logprobs(token_ids)

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_group(
        self, name: str, backend: str, master_addr: str, master_port: int, group_size: int, timeout_s: float
    ) -> None:
        """Join the trainer's weight-transfer group as group rank ``1 + rank`` (trainer rank 0 is rank 0)."""
        from roll.distributed.collective import create_group

        self.weight_group = create_group(
            name, backend, master_addr, master_port, 1 + self.rank, group_size, timeout_s
        )

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, plan: list[Any], version: int, timeout_s: float) -> dict[str, Any]:
        """Take ``version`` of the weights from the trainer, bucket by bucket, into the engine's model."""
        from roll.distributed.weight_transfer import receive_weights

        self._check_newer(version)
        if self.weight_group is None:
            raise RuntimeError("no weight-transfer group: call join_weight_group first")
        device = self.device if self.weight_group.backend == "nccl" else torch.device("cpu")
        with self.engine.weight_update(version):  # no decode step sees half the buckets
            stats = receive_weights(self.weight_group, plan, version, timeout_s, device, self._load_bucket)
        self.weights_version = version
        return score_after_transfer(stats, self.engine.prompt_logprobs, self.probe_sequences)

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, state_dict: dict[str, Any], version: int) -> int:
        """Replace the weights with ``state_dict`` (e.g. a checkpoint); ``version`` must move forward."""
        self._check_newer(version)
        self.engine.load_weights(state_dict, version=version)
        self.weights_version = version
        return version

    def _check_newer(self, version: int) -> None:
        """Versions only move forward: staleness is the distance between a token's version and the
        trainer's, so a version that went back would make old tokens look fresh."""
        if version <= self.weights_version:
            raise ValueError(f"weights version {version} is not newer than the loaded {self.weights_version}")

    # ------------------------------------------------------------ weights through shared memory (one node)
    @register(Dispatch.ONE_TO_ALL)
    def weight_endpoint(self, shm_dir: str) -> Any:
        """Where this worker runs (node, IP, device, free shared memory): picks the weight-transfer path."""
        from roll.distributed.shm_transfer import local_endpoint

        return local_endpoint(self.device, shm_dir)

    @register(Dispatch.ONE_TO_ALL)
    def open_shared_weights(self, info: Any, plan: list[Any]) -> None:
        """Map the trainer's shared weight segment (kept for every later sync)."""
        from roll.distributed.shm_transfer import SharedWeights

        self.close_shared_weights()
        self._shared_weights = SharedWeights.open(info, plan)

    @register(Dispatch.ONE_TO_ALL)
    def load_shared_weights(self, version: int) -> dict[str, Any]:
        """Copy ``version`` of the weights, which the trainer has just written to the shared segment,
        into the engine's model."""
        from roll.distributed.shm_transfer import read_weights

        self._check_newer(version)
        segment = getattr(self, "_shared_weights", None)
        if segment is None:
            raise RuntimeError("no shared weight segment: call open_shared_weights first")
        with self.engine.weight_update(version):  # no decode step sees half the buckets
            stats = read_weights(segment, version, self._load_bucket)
        self.weights_version = version
        return score_after_transfer(stats, self.engine.prompt_logprobs, self.probe_sequences)

    @register(Dispatch.ONE_TO_ALL)
    def close_shared_weights(self) -> None:
        """Drop this worker's mapping of the shared weight segment (idempotent)."""
        segment = getattr(self, "_shared_weights", None)
        if segment is not None:
            segment.close()
            self._shared_weights = None
