"""What a token of KV cache costs a model, read from its config: the inference engines' caches are sized
with it (``rollout.vllm.kv_cache_gb``, ``roll serve --engine vllm``) before any engine starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class AttentionShape:
    """The KV cache's shape per token, and the longest sequence the model's positions allow."""

    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int | None

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    @classmethod
    def of_config(cls, config: Any) -> AttentionShape:
        """From a transformers config (a vision-language model's decoder: its ``text_config``)."""
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        positions = getattr(config, "max_position_embeddings", None)
        return cls(config.num_hidden_layers, kv_heads, head_dim, positions)

    @classmethod
    def of_directory(cls, path: str) -> AttentionShape:
        """From a model directory's config.json (read, not loaded)."""
        from transformers import AutoConfig

        return cls.of_config(AutoConfig.from_pretrained(path, local_files_only=True))
