"""Runs inside vLLM's worker (``worker_extension_cls``): new weights copied into the live model in place.

vLLM's own ``reload_weights`` takes Hugging Face names (it fuses q/k/v and gate/up itself) and, on a
CPU, repacks the linear layers after loading, which the model's plain ``load_weights`` would not do."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class WeightReceiver:
    """Mixed into vLLM's worker class by vLLM; ``self`` is the worker."""

    def roll_load_weights(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=iter(pairs))  # type: ignore[attr-defined]
