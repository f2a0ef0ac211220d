"""Reward worker: scores responses with a registered reward function."""

from __future__ import annotations

import torch

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register


def response_token_ids(batch: Batch) -> list[list[int]] | list[None]:
    """Per row, the response's token ids without padding (``response_ids[i][response_mask[i]]``), or
    ``None`` per row when the batch carries no ``response_ids``/``response_mask``."""
    if "response_ids" not in batch or "response_mask" not in batch:
        return [None] * len(batch)
    ids, mask = batch["response_ids"], batch["response_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


class RewardWorker(Worker):
    """``config`` is the reward function's registry name."""

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: Batch, function: str | None = None) -> Batch:
        """Score rows with ``prompt_text``, ``response_text`` and the dataset row ``sample`` (plus, when
        present, ``response_ids``/``response_mask`` [B, T], handed to rewards that declare
        ``response_ids``), with the worker's reward function or, when given, the registered ``function``
        (evaluation).

        Returns:
            A Batch with ``scores`` [B] float32 and the non-tensor ``token_rewards``: per row the
            reward's per-token rewards (a list of floats, one per response token) or None.
        """
        from roll.rewards import score_response

        name = function or self.config
        outputs = [
            score_response(name, prompt, response, sample, response_ids=ids)
            for prompt, response, sample, ids in zip(
                batch["prompt_text"], batch["response_text"], batch["sample"], response_token_ids(batch)
            )
        ]
        return Batch(
            tensors={"scores": torch.tensor([out.score for out in outputs], dtype=torch.float32)},
            non_tensors={
                "token_rewards": [
                    None if out.token_rewards is None else [float(r) for r in out.token_rewards]
                    for out in outputs
                ]
            },
        )
