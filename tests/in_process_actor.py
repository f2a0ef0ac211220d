"""The real actor worker in the test's own process (one rank), for tests of what happens inside a step."""

from __future__ import annotations

from typing import Any

import torch

from roll.strategies.fsdp import local_tensor
from roll.workers.actor import ActorSpec, ActorWorker, CrossEntropySpec, OptimizerSpec
from roll.workers.base import ModelSpec


class Actor:
    """A context manager over one ActorWorker; its (one-rank) process group is torn down on exit, so the
    next one can make its own. It trains SFT's cross-entropy (``train_step`` on an SFT batch) unless
    ``spec_changes`` (ActorSpec fields) say otherwise; ``model_changes`` set ModelSpec ones."""

    def __init__(
        self,
        path: str,
        dtype: str,
        lr: float = 1e-6,
        model_changes: dict[str, Any] | None = None,
        **spec_changes: Any,
    ) -> None:
        spec = ActorSpec(
            model=ModelSpec(path=path, dtype=dtype, **(model_changes or {})),
            optimizer=OptimizerSpec(lr=lr, total_steps=10),
            micro_batch_size=4,
            **{"loss": CrossEntropySpec(), **spec_changes},
        )
        self.worker = ActorWorker("actor", 0, 1, spec)

    def __enter__(self) -> ActorWorker:
        self.worker.setup()
        return self.worker

    def __exit__(self, *_: object) -> None:
        self.worker.shutdown()


def weights(worker: ActorWorker) -> dict[str, torch.Tensor]:
    """A copy of this rank's weights (its shards when sharded), by name."""
    return {name: local_tensor(p).detach().clone() for name, p in worker.model.named_parameters()}
