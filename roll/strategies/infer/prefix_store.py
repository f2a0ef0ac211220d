"""KV caches kept between the turns of an episode, so that a turn prefills only its new tokens.

Turn k of an agentic episode is one request whose prompt is the whole episode so far. Prefilling each
turn from scratch costs O(k^2) tokens over an episode; with the KV cache of turn k-1 kept under the
episode's ``cache_key`` (``GenerateRequest.cache_key``), turn k computes only the tokens after it.

The store is bounded in tokens (``max_tokens``, across entries) and evicts the least recently stored
entry first. Each entry is taken at most once: the turn that uses it stores a longer one when it ends.
It holds the counters a benchmark reads (``stats``). Thread-safe; the engine's serving thread stores and
takes, callers release and read the counters.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_PREFIX_CACHE_TOKENS", "LayerStates", "PrefixStore", "StoredPrefix"]

# Enough for 32 episodes of 2k-token context per engine, which covers the episodes a CPU or small-GPU
# worker steps at once. A token's KV costs 2 x layers x kv_heads x head_dim x dtype bytes: 12 KiB for
# Qwen2.5-0.5B in bf16 (768 MiB at this default), 56 KiB for a 7B (3.5 GiB).
DEFAULT_PREFIX_CACHE_TOKENS = 65536

# One sequence's (keys, values) per attention layer, each [kv_heads, tokens, head_dim].
LayerStates = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StoredPrefix:
    """The KV of ``token_ids`` (one per attention layer), computed with the weights in use when stored."""

    token_ids: tuple[int, ...]
    layers: LayerStates

    def __len__(self) -> int:
        return len(self.token_ids)


def reusable_length(stored: Sequence[int], prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` whose KV ``stored`` holds: their common prefix (a token's KV depends only on
    the tokens up to it), leaving at least the prompt's last token to compute, whose logits are needed."""
    limit = min(len(stored), len(prompt) - 1)
    if limit <= 0:
        return 0
    if tuple(prompt[:limit]) == tuple(stored[:limit]):  # the usual case, compared in one go
        return limit
    return next(i for i, (a, b) in enumerate(zip(stored[:limit], prompt[:limit])) if a != b)


class PrefixStore:
    """Stored prefixes by cache key, at most ``max_tokens`` tokens in all (0 keeps nothing)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredPrefix] = OrderedDict()  # least recently stored first
        self._held = 0
        self._counts = dict.fromkeys(("prefill_tokens", "reused_tokens", "hits", "misses", "evicted"), 0)

    def fits(self, tokens: int) -> bool:
        """Whether an entry of ``tokens`` tokens can be stored at all (checked before copying its KV)."""
        return 0 < tokens <= self.max_tokens

    def put(self, key: str, prefix: StoredPrefix) -> None:
        """Store ``prefix`` under ``key`` (replacing an older one), evicting the least recently stored
        entries until it fits; one larger than the whole store is not kept (counted as evicted)."""
        with self._lock:
            self._drop(key)
            if not self.fits(len(prefix)):
                self._counts["evicted"] += 1
                return
            while self._held + len(prefix) > self.max_tokens:
                self._drop(next(iter(self._entries)))
                self._counts["evicted"] += 1
            self._entries[key] = prefix
            self._held += len(prefix)

    def take(self, key: str | None, prompt_ids: Sequence[int]) -> tuple[int, LayerStates | None]:
        """Remove ``key``'s entry and return how many leading tokens of ``prompt_ids`` it covers with
        their KV (sliced to that length); (0, None) when there is none or it shares no prefix."""
        if key is None:
            return 0, None
        with self._lock:
            prefix = self._entries.pop(key, None)
            if prefix is not None:
                self._held -= len(prefix)
            length = 0 if prefix is None else reusable_length(prefix.token_ids, prompt_ids)
            self._counts["hits" if length else "misses"] += 1
        if not length:
            return 0, None
        assert prefix is not None
        return length, [(keys[:, :length], values[:, :length]) for keys, values in prefix.layers]

    def count_prefill(self, computed: int, reused: int) -> None:
        """Count a prefill's prompt tokens: ``computed`` by the model, ``reused`` from here."""
        with self._lock:
            self._counts["prefill_tokens"] += computed
            self._counts["reused_tokens"] += reused

    def release(self, keys: Iterable[str]) -> int:
        """Free the entries of ``keys``; returns how many there were."""
        with self._lock:
            return sum(self._drop(key) for key in keys)

    def clear(self) -> None:
        """Free every entry (new weights make them stale; released memory must not hold them)."""
        with self._lock:
            self._entries.clear()
            self._held = 0

    def stats(self) -> dict[str, int]:
        """Counters since the start: ``prefill_tokens`` (prompt tokens computed), ``reused_tokens`` (prompt
        tokens whose KV came from the store), ``hits`` and ``misses`` (requests with a cache key that
        did or did not find a usable prefix), ``evicted`` (entries dropped for room); and the store's
        state now: ``entries`` and ``tokens_held``."""
        with self._lock:
            return {**self._counts, "entries": len(self._entries), "tokens_held": self._held}

    def _drop(self, key: str) -> bool:
        """Remove ``key``'s entry (caller holds the lock); whether there was one."""
        prefix = self._entries.pop(key, None)
        if prefix is None:
            return False
        self._held -= len(prefix)
        return True
