"""Sampling parameters shared by every inference engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def as_greedy(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            greedy=True,
        )
