"""Inference engines: the ``InferenceEngine`` contract and the ``INFERENCE_ENGINES`` registry.

Build one by name: ``INFERENCE_ENGINES.get("hf")(model=..., tokenizer=..., device=...)``.
"""

from __future__ import annotations

from typing import Any

from roll.strategies.infer.base import INFERENCE_ENGINES, InferenceEngine, NamedTensors

__all__ = ["INFERENCE_ENGINES", "InferenceEngine", "NamedTensors"]


# devices_per_worker: the devices one worker can use (rollout.num_devices_per_worker is held to it).
@INFERENCE_ENGINES.register("hf", devices_per_worker=1)
def build_hf_engine(model: Any, tokenizer: Any, device: Any = None, **kwargs: Any) -> InferenceEngine:
    """An ``HFEngine`` (Hugging Face ``generate``) serving ``model``; see its docstring for ``kwargs``."""
    from roll.strategies.infer.hf import HFEngine

    return HFEngine(model, tokenizer, device, **kwargs)
