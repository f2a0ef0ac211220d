"""Critic worker: the value model that GAE needs. Same data-parallel training as the actor, its own
optimizer, and a clipped value loss against the returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from roll.data.batch import Batch
from roll.data.masks import loss_mask
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import register
from roll.models.loading import VALUE_HEAD
from roll.strategies.hf_forward import response_values
from roll.workers.base import ModelSpec
from roll.workers.trainer import TrainerSpec, TrainerWorker

# Value regression has no reason to weigh long and short responses differently per token.
VALUE_LOSS_AGGREGATION = "token-mean"


@dataclass
class CriticSpec(TrainerSpec):
    value_clip: float = 0.2


class CriticWorker(TrainerWorker):
    """``config`` is a CriticSpec; its model is a value model (``load_value_model``)."""

    def model_builder(self, spec: ModelSpec) -> Callable[[], torch.nn.Module]:
        """The value model from its config (sharded loading)."""
        from roll.models.loading import build_value_model

        return lambda: build_value_model(spec.path, spec.attn_implementation)

    def new_weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """From the policy's checkpoint the value head is new: it starts at zero (values start at 0)."""
        return torch.zeros(shape) if name.startswith(VALUE_HEAD) else None

    def load_model(self, spec: ModelSpec) -> torch.nn.Module:
        from roll.models.loading import load_value_model

        return load_value_model(
            spec.path, self.weights_dtype(spec), self.device, attn_implementation=spec.attn_implementation
        )

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, R]: the value of the state before each response token, 0 past the response."""
        with torch.no_grad():  # not inference_mode: FSDP writes gathered weights in place
            values = response_values(self.model, batch.to(self.device))
        return Batch(tensors={"values": values.cpu()})

    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: Batch) -> dict[str, float]:
        """Regress values on ``returns`` [B, R]; ``values`` [B, R] (from ``compute_values`` at rollout
        time) anchor the value clipping."""
        return self.update(batch, self._value_loss, VALUE_LOSS_AGGREGATION)

    def _value_loss(self, micro: Batch, denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
        from roll.algorithms.losses import value_loss

        spec: CriticSpec = self.config
        values = response_values(self.model, micro)
        loss, metrics = value_loss(
            values,
            micro["values"],
            micro["returns"],
            loss_mask(micro).float(),
            clip_range_value=spec.value_clip,
            loss_agg_mode=VALUE_LOSS_AGGREGATION,
            denominator=denominator,
        )
        return loss, {**metrics, "loss": loss.item()}
