"""The weight-sync probe: after a sync, the trainer and every inference engine score the same few fixed
token sequences, and their logprobs must agree.

A transfer that reports success can still leave an engine on the wrong weights: an adapter that was never
merged, a load that copied nothing, names that matched the wrong tensors, a dtype cast gone wrong. Peers
have trained on for hours that way. The probe checks what matters, the distribution the engine samples
from, end to end and on every rollout rank: the largest |trainer - engine| logprob over the probe's tokens
(``sync/max_logprob_diff``) above the tolerance fails the run with an error naming the weights version.

What it can see: a difference in weights that moves some probe token's logprob by more than the tolerance.
One optimizer step at an RL learning rate may move logprobs by less than that, so a sync that failed once
may pass; but an engine left behind drifts further from the trainer with every step, and the probe fails
within a few (the quickstart's no-op sync is caught at the step docs/lora.md gives).

Cost: one forward pass of ``sequences`` x 16 tokens on the trainer and on each engine per sync, inside
the transfer's own calls (no Ray round trip of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PROBE_TOKENS = 16  # tokens per probe sequence: enough positions to see a change, cheap to score
# Default tolerances by model dtype. float32: trainer and engine run the same forward on the same weights;
# what remains is LoRA's unmerged (trainer) vs merged (engine) arithmetic, below 1e-4 on the tiny models.
# bfloat16/float16: a merged weight is rounded once more than the trainer's unmerged sum, and one rounding
# of a bf16 weight (8 bits of mantissa) moves logprobs by up to a few hundredths.
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


class SyncCheckError(RuntimeError):
    """After a weight sync an engine's logprobs differ from the trainer's by more than the tolerance."""


def probe_sequences(vocab_size: int, count: int, seed: int, length: int = PROBE_TOKENS) -> list[list[int]]:
    """``count`` fixed sequences of ``length`` token ids drawn uniformly from the vocabulary (the same for
    a seed, so every sync of a run is scored on the same tokens). Random ids, not text: every probe token
    is unlikely under any model, so its logprob reads the weights of every layer, and no dataset is needed
    (agentic runs have none)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


def default_tolerance(dtype: str) -> float:
    return DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE["bfloat16"])


@dataclass(frozen=True)
class ProbeSpec:
    """The probe a run checks its syncs with (``rollout.sync_probe_*``, the tolerance resolved)."""

    sequences: int
    tolerance: float


@dataclass
class SyncProbe:
    """The probe of one weight sync connection: ``sequences`` are given to both ends once
    (``set_sync_probe``); each end scores them right after every transfer, inside its own transfer call
    (no extra round trip), and ``compare`` checks the scores the calls returned."""

    sequences: list[list[int]]
    tolerance: float
    trainer_role: str = "actor"
    inference_role: str = "rollout"

    def compare(self, version: int, trainer: Any, engines: list[Any]) -> dict[str, float]:
        """Check each engine's logprobs (one list per rollout rank) against the trainer's after the sync
        of weights ``version``; returns ``max_logprob_diff`` over every rank and token.

        Raises:
            SyncCheckError: naming the version, the worst rollout rank, its difference and the tolerance.
        """
        reference = _flat(trainer)
        diffs = [
            float((_flat(engine) - reference).abs().max()) if len(reference) else 0.0 for engine in engines
        ]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        if not diffs[worst] <= self.tolerance:  # NaN fails too
            raise SyncCheckError(
                f"weights version {version} did not reach {self.inference_role} rank {worst}: after the sync "
                f"its logprobs on the {len(self.sequences)} probe sequences differ from "
                f"{self.trainer_role}'s by up to {diffs[worst]:.3g} (tolerance {self.tolerance:g}; all "
                f"ranks: {', '.join(f'{d:.3g}' for d in diffs)}). The engine is not serving the trained "
                "weights (an adapter or bucket not loaded, names or dtypes mismatched); the run stops "
                "rather than train on samples from other weights. If the tolerance is too tight for "
                "this dtype, raise rollout.sync_probe_tolerance"
            )
        return {"max_logprob_diff": diffs[worst]}


def score_after_transfer(
    stats: dict[str, Any], score: Callable[[list[list[int]]], Any], sequences: list[list[int]] | None
) -> dict[str, Any]:
    """``stats`` of a transfer with the probe's scores added (``probe_logprobs``, ``probe_s``) when this
    end has probe ``sequences``: ``score(sequences)`` runs right after the weights were loaded or sent."""
    if not sequences:
        return stats
    start = time.perf_counter()
    return {**stats, "probe_logprobs": score(sequences), "probe_s": time.perf_counter() - start}


def _flat(logprobs: Any) -> torch.Tensor:
    return torch.tensor([value for row in logprobs for value in row], dtype=torch.float64)
