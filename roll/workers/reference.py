"""Reference worker: a frozen model scoring tokens (the initial policy for KL regularisation, a DPO
reference, a distillation teacher)."""

from __future__ import annotations

from dataclasses import dataclass

from roll.workers.base import ModelSpec, ModelWorker


@dataclass
class ReferenceSpec:
    """What a reference worker receives: only the model it loads."""

    model: ModelSpec


class ReferenceWorker(ModelWorker):
    """Holds its model unchanged; ``compute_logprobs`` gives the reference logprobs. ``config`` is a
    ReferenceSpec."""
