"""Reward worker: scores responses with a registered reward function."""

from __future__ import annotations

import torch

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register


class RewardWorker(Worker):
    """``config`` is the reward function's registry name."""

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: Batch, function: str | None = None) -> Batch:
        """``scores`` [B] for rows with ``prompt_text``, ``response_text`` and the dataset row ``sample``,
        from the worker's reward function or, when given, the registered ``function`` (evaluation)."""
        from roll.rewards import score_response

        name = function or self.config
        scores = [
            score_response(name, prompt, response, sample).score
            for prompt, response, sample in zip(batch["prompt_text"], batch["response_text"], batch["sample"])
        ]
        return Batch(tensors={"scores": torch.tensor(scores, dtype=torch.float32)})
