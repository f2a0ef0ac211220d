"""Rollout worker: the inference engine that samples responses (Hugging Face ``generate`` for now)."""

from __future__ import annotations

from typing import Any

import torch

from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import register
from roll.workers.base import ModelWorker


class RolloutWorker(ModelWorker):
    """Samples responses (``generate``, from ModelWorker) and takes new weights from the trainer."""

    weights_version: int = -1

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, state_dict: dict[str, Any], version: int) -> int:
        """Replace the weights with the trainer's ``state_dict``; ``version`` must move forward."""
        if version <= self.weights_version:
            raise ValueError(f"weights version {version} is not newer than the loaded {self.weights_version}")
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        # Tied embeddings may be absent from the sender's dict; anything else missing is a real mismatch.
        missing = [k for k in missing if k not in self._tied_parameter_names()]
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the rollout model: missing {missing}, unexpected {unexpected}"
            )
        self.weights_version = version
        return version

    def _tied_parameter_names(self) -> set[str]:
        tied = getattr(self.model, "_tied_weights_keys", None) or []
        return set(tied if isinstance(tied, (list, tuple, set)) else tied.keys())
