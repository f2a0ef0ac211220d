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


@INFERENCE_ENGINES.register("vllm", devices_per_worker=1)
def build_vllm_engine(spec: Any, tokenizer: Any, device: Any) -> InferenceEngine:
    """A ``VLLMEngine`` over the model directory (``spec.engine_options``: ``rollout.vllm``)."""
    import torch

    from roll.strategies.infer.vllm import VLLMEngine

    options = spec.engine_options
    return VLLMEngine(
        spec.model.path,
        tokenizer,
        dtype=spec.model.dtype,
        seed=torch.initial_seed(),  # the worker's: the run's seed + its rank
        max_running_requests=spec.max_running_requests,
        max_model_len=options.get("max_model_len"),
        kv_cache_bytes=int(options.get("kv_cache_gb", 0.25) * (1 << 30)),
        enforce_eager=options.get("enforce_eager", True),
    )
