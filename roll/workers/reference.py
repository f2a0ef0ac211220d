"""Reference worker: the frozen initial policy, for KL regularisation."""

from __future__ import annotations

from roll.workers.base import ModelWorker


class ReferenceWorker(ModelWorker):
    """Holds the initial policy unchanged; ``compute_logprobs`` gives the reference logprobs."""
