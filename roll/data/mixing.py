"""Batches that mix several domains in configured ratios, resumable like ``PromptIterator``."""

from __future__ import annotations

import math

from roll.data.dataset import DatasetError, PromptIterator

__all__ = ["DomainMixer", "apportion"]


def apportion(ratios: list[float], drawn: list[int], size: int) -> list[int]:
    """How many of the next ``size`` prompts each domain gets so that, after them, every domain's total
    is within one prompt of its share ``ratios[d] / sum(ratios)`` of all prompts drawn (largest
    remainder on the running totals; ties go to the earlier domain).

    Args:
        ratios: positive weight per domain.
        drawn: prompts each domain has had so far.
        size: prompts to hand out now.
    """
    total = sum(drawn) + size
    scale = sum(ratios)
    owed = [max(0.0, r / scale * total - d) for r, d in zip(ratios, drawn)]
    counts = [min(math.floor(o), size) for o in owed]
    while sum(counts) > size:  # only when a domain was far ahead; take from the largest
        counts[counts.index(max(counts))] -= 1
    by_remainder = sorted(range(len(ratios)), key=lambda d: (-(owed[d] - counts[d]), d))
    for d in by_remainder[: size - sum(counts)]:
        counts[d] += 1
    return counts


class DomainMixer:
    """Endless batches of ``batch_size`` row indices into the concatenation of the domains' rows (in the
    order of ``sizes``), each domain holding its share of every batch (``apportion``). Every domain is
    shuffled and cycled on its own, seeded, so a small domain repeats sooner than a large one and the
    order never depends on the other domains' sizes.

    The same interface as ``PromptIterator`` (``next_indices``, ``state_dict``, ``load_state_dict``), so
    the rollout scheduler draws from either.
    """

    def __init__(self, sizes: dict[str, int], ratios: dict[str, float], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1, got {batch_size}")
        self.names = list(sizes)
        self.ratios = [float(ratios[name]) for name in self.names]
        self.batch_size = batch_size
        self.offsets = [0]
        for name in self.names[:-1]:
            self.offsets.append(self.offsets[-1] + sizes[name])
        self.orders = {
            name: PromptIterator([{}] * sizes[name], 1, seed=f"{seed}:{name}")  # type: ignore[arg-type]
            for name in self.names
        }
        self.drawn = [0] * len(self.names)

    def next_indices(self) -> list[int]:
        counts = apportion(self.ratios, self.drawn, self.batch_size)
        per_domain = []
        for d, (name, count) in enumerate(zip(self.names, counts)):
            per_domain.append([self.offsets[d] + self.orders[name].next_indices()[0] for _ in range(count)])
            self.drawn[d] += count
        # Interleaved, so each stretch of the batch (and each rollout worker's share) mixes domains.
        longest = max(counts)
        return [part[i] for i in range(longest) for part in per_domain if i < len(part)]

    def state_dict(self) -> dict:
        return {
            "domains": list(self.names),
            "ratios": list(self.ratios),
            "drawn": list(self.drawn),
            "orders": {name: it.state_dict() for name, it in self.orders.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``.

        Raises:
            DatasetError: the domains, their ratios or their data differ from the run that saved it.
        """
        if state.get("domains") != self.names or state.get("ratios") != self.ratios:
            raise DatasetError(
                "cannot resume the prompt order because the domains changed (saved "
                f"{dict(zip(state.get('domains', []), state.get('ratios', [])))}, now "
                f"{dict(zip(self.names, self.ratios))})"
            )
        for name, it in self.orders.items():
            it.load_state_dict(state["orders"][name])
        self.drawn = [int(n) for n in state["drawn"]]
