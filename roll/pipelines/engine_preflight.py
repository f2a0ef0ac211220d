"""Preflight of the vllm engine against the model's shape: its ``max_model_len`` within the model's
positions, and a KV cache that holds one sequence of it, so that a cache too small or a context too long
stops the run at load, naming the key, instead of when vLLM starts inside a rollout worker.

On CUDA an unset ``kv_cache_gb`` means ``gpu_memory_utilization`` sizes the cache from the GPU's free
memory, which only vLLM's own start can measure; there it checks the same thing itself.
"""

from __future__ import annotations

import math
from typing import Any

from roll.config.common import ModelConfig, cluster_to_join
from roll.config.engine_checks import longest_sequence
from roll.models.attention_shape import AttentionShape
from roll.strategies.infer.vllm import CPU_BLOCK_TOKENS, CPU_KV_CACHE_GB


def attention_shape(model: ModelConfig) -> AttentionShape:
    """From ``model.path``'s config.json, or from ``model.tiny``."""
    if model.path is not None:
        return AttentionShape.of_directory(model.path)
    tiny = model.tiny
    head_dim = tiny.hidden_size // tiny.num_attention_heads
    return AttentionShape(
        tiny.num_hidden_layers, tiny.num_key_value_heads, head_dim, tiny.max_position_embeddings
    )


def vllm_max_model_len(cfg: Any) -> int:
    """The ``max_model_len`` the engine gets: ``rollout.vllm.max_model_len``, else what the run needs."""
    declared = cfg.rollout.vllm.max_model_len if cfg.rollout.vllm else None
    return declared or longest_sequence(cfg)[0]


def check_vllm_fits(cfg: Any, gpus_here: int | None) -> list[str]:
    """The vllm engine's context and KV cache against the model (``gpus_here``: the local GPUs, which
    decide whether rollout workers with a device mapping run on CUDA)."""
    rollout = getattr(cfg, "rollout", None)  # SFT and DPO have none
    if rollout is None or rollout.engine != "vllm" or rollout.hybrid_engine:
        return []
    shape = attention_shape(cfg.model)
    length = vllm_max_model_len(cfg)
    declared = rollout.vllm.max_model_len if rollout.vllm else None
    key = "rollout.vllm.max_model_len" if declared else longest_sequence(cfg)[1]
    problems = []
    if shape.max_positions is not None and length > shape.max_positions:
        problems.append(
            f"{key} = {length} exceeds the model's max_position_embeddings ({shape.max_positions}): vLLM "
            "refuses to start; shorten it"
        )
    kv_gb = rollout.vllm.kv_cache_gb if rollout.vllm else None
    on_cuda = (
        rollout.device_mapping is not None
        and cfg.ray.num_gpus is None
        and (cluster_to_join(cfg.ray) is not None or bool(gpus_here))
    )
    if kv_gb is None and on_cuda:
        return problems  # gpu_memory_utilization: vLLM measures the GPU at its start
    gib = kv_gb if kv_gb is not None else CPU_KV_CACHE_GB
    per_token = shape.kv_bytes_per_token(cfg.model.inference())
    held = int(gib * (1 << 30)) // per_token
    needed = math.ceil(length / CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS  # whole blocks (CUDA's are smaller)
    if held < needed:
        setting = "" if kv_gb is not None else f" (unset: {gib:g} GiB on a CPU)"
        problems.append(
            f"rollout.vllm.kv_cache_gb={gib:g}{setting} holds {held} tokens of this model's KV cache "
            f"({per_token} bytes a token in {cfg.model.inference()}), fewer than one sequence of "
            f"max_model_len {length} ({key}): vLLM refuses to start; raise rollout.vllm.kv_cache_gb to "
            f"at least {math.ceil(needed * per_token / (1 << 30) * 100) / 100:g} or shorten {key}"
        )
    return problems
