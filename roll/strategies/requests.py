"""What the rollout side asks of an inference engine and what it gets back: sampling parameters, a
request, its result. Plain data without torch, so that the rollout scheduler's bookkeeping
(``roll.rollout.lifecycle``) and anything else that only passes requests around load without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from roll.data.images import VisionInputs

__all__ = ["FINISH_REASONS", "FinishReason", "GenerateRequest", "GenerateResult", "SamplingParams"]

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response. Hashable: engines batch requests with equal params together.

    ``stop_token_ids`` end a response (finish reason "stop", the stop token kept) besides the model's
    end-of-sequence ids, which always do (``roll.models.loading.end_of_sequence_ids``): e.g. the token
    that closes a turn of a multi-turn episode. ``stop``: strings of any length that end it at the token
    whose text completes one (kept: the sampled ids are what trains; an API's reply text ends before it,
    ``stop_text_end``)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def as_greedy(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            greedy=True,
            stop_token_ids=self.stop_token_ids,
            stop=self.stop,
        )


def stop_string_end(tokenizer: Any, tokens: list[int], new: int, stops: tuple[str, ...]) -> int | None:
    """The length of ``tokens`` up to the first of its last ``new`` tokens whose text completes one of
    ``stops`` (None: none does); engines check at every step, so the first to complete one ends the
    response. Only a tail is decoded: a stop string of n characters lies within the last n + 8 tokens, as
    every token but a partial UTF-8 byte decodes to one character at least."""
    window = max(len(stop) for stop in stops) + 8
    for end in range(len(tokens) - new + 1, len(tokens) + 1):
        text = tokenizer.decode(tokens[max(0, end - window) : end], skip_special_tokens=True)
        if any(stop and stop in text for stop in stops):
            return end
    return None


def stop_text_end(text: str, stops: tuple[str, ...]) -> int:
    """Where ``text`` ends for an API reply: before the first of ``stops`` in it (its length if none)."""
    found = [text.find(stop) for stop in stops if stop and stop in text]
    return min(found, default=len(text))


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete.

    Args:
        request_id: unique among the engine's unfinished requests; the handle for ``await_result``
            and ``abort``.
        prompt_ids: the prompt's token ids (no padding); stored as a tuple so the request is immutable.
        params: how to sample; requests with equal params can share one batch.
        cache_key: names a sequence of requests whose prompts extend one another (an episode id: turn
            k's prompt is turn k-1's prompt, its sampled tokens and the next observation). An engine may
            keep the KV cache of such a request when it ends and start the next request of the same key
            from it, prefilling only the new tokens (``HFEngine``'s prefix store). A hint only: results
            are the same with or without it. None: nothing is kept.
        vision: the pixel values and image grids of the prompt's images (a vision-language model's
            prompt, whose ``prompt_ids`` hold each image's placeholders already expanded); None: text.
    """

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    cache_key: str | None = None
    vision: VisionInputs | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        prompt_ids = tuple(int(t) for t in self.prompt_ids)
        if not prompt_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt; give at least one token id")
        # Frozen dataclass: __setattr__ is blocked, so normalise through object.__setattr__.
        object.__setattr__(self, "prompt_ids", prompt_ids)


@dataclass
class GenerateResult:
    """What became of one request.

    ``token_ids`` are the generated tokens up to and including EOS (no padding); ``logprobs`` holds one
    value per token, the log-probability of the sampled token under the sampling temperature (the same
    quantity as ``rollout_logprobs`` of batch generation). ``finish_reason`` is "stop" (EOS), "length"
    (``max_new_tokens`` reached) or "abort" (``abort`` was called; the tokens are those produced so far,
    none for a request that had not started). ``weight_versions`` holds, per token, the version of the
    weights that sampled it (the ``version`` given to ``load_weights`` or ``weight_update``; -1 for an
    engine never given one, while the rollout worker labels a run's initial weights 0): a request in
    flight across a weight update shows both versions, which is what staleness bounds are checked on.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_versions: list[int] = field(default_factory=list)
