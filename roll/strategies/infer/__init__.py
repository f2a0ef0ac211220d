"""Inference engines: the ``InferenceEngine`` contract and the ``INFERENCE_ENGINES`` registry.

Build one by name from a rollout worker's spec (``roll.workers.rollout.RolloutSpec``: the model's path,
dtype and seed, the engine's options): ``INFERENCE_ENGINES.get("hf")(spec, tokenizer, device)``. Each
engine loads the model its own way.
"""

from __future__ import annotations

from typing import Any

from roll.strategies.infer.base import INFERENCE_ENGINES, InferenceEngine, NamedTensors

__all__ = ["INFERENCE_ENGINES", "InferenceEngine", "NamedTensors"]


# devices_per_worker: the devices one worker can use (rollout.num_devices_per_worker is held to it).
@INFERENCE_ENGINES.register("hf", devices_per_worker=1)
def build_hf_engine(spec: Any, tokenizer: Any, device: Any) -> InferenceEngine:
    """An ``HFEngine``: ROLL's continuous batching over the Hugging Face model, loaded here."""
    from roll.models.loading import load_causal_lm
    from roll.strategies.infer.hf import HFEngine

    model = spec.model
    loaded = load_causal_lm(model.path, model.dtype, device, attn_implementation=model.attn_implementation)
    return HFEngine(loaded, tokenizer, device, spec.max_running_requests, spec.prefix_cache_tokens)


@INFERENCE_ENGINES.register("vllm", devices_per_worker=None)  # tensor parallelism: any number
def build_vllm_engine(spec: Any, tokenizer: Any, device: Any) -> InferenceEngine:
    """A ``VLLMEngine`` over the model directory (``spec.engine_options``: ``rollout.vllm``, resolved by
    the pipeline), with the defaults of the device it runs on: on CUDA the KV cache is what
    ``gpu_memory_utilization`` leaves, CUDA graphs are on, and a rollout colocated with a trainer sleeps
    between generations; on a CPU the cache is ``CPU_KV_CACHE_GB``, the engine is eager and stays
    resident (the stages take turns; there is nothing to free)."""
    import torch

    from roll.strategies.infer.vllm import CPU_KV_CACHE_GB, VLLMEngine

    options = spec.engine_options
    on_cuda = torch.device(device).type == "cuda"
    kv_gb = options.get("kv_cache_gb") or (None if on_cuda else CPU_KV_CACHE_GB)
    eager = options.get("enforce_eager")
    colocated = options.get("colocated", False)
    return VLLMEngine(
        spec.model.path,
        tokenizer,
        dtype=spec.model.dtype,
        seed=torch.initial_seed(),  # the worker's: the run's seed + its rank
        max_running_requests=spec.max_running_requests,
        max_model_len=options.get("max_model_len"),
        kv_cache_bytes=None if kv_gb is None else int(kv_gb * (1 << 30)),
        gpu_memory_utilization=options.get("gpu_memory_utilization") or (0.5 if colocated else 0.85),
        enforce_eager=(not on_cuda) if eager is None else eager,
        tensor_parallel_size=options.get("tensor_parallel_size", 1),
        sleeps=on_cuda and colocated,
    )
