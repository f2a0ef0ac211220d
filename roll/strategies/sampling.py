"""The token sampler of ROLL's own engine (``SamplingParams`` is in ``roll.strategies.requests``)."""

from __future__ import annotations

import torch

from roll.strategies.requests import SamplingParams


def sample_tokens(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [B, V] and return (tokens [B], logprobs [B] float32).

    The logprob is that of the chosen token under the full softmax of ``logits / temperature`` (greedy:
    temperature 1), before top-k / top-p truncation: the quantity the trainer recomputes from the same
    logits, so importance ratios compare like with like. Truncation only shapes which token is drawn.
    Draws come from torch's global generator, so a seeded run repeats itself.
    """
    scaled = logits.float()
    if not params.greedy and params.temperature != 1.0:
        scaled = scaled / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        tokens = draw(_truncated_probs(logprobs, params))
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` [B, V] (non-negative, each row's sum > 0), drawn with probability
    proportional to its entry: by inverse CDF, one uniform number per row from torch's global generator.

    ``torch.multinomial`` does the same but draws random numbers across the whole vocabulary: on 2 CPU
    cores it took 0.33 s per decode step for 64 rows of a 151,936-token vocabulary, this 0.06 s
    (benchmarks/generation_memory.py). The running sum is float64, so rounding cannot favour a token."""
    cumulative = probs.double().cumsum(dim=-1)
    # A point in (0, total]; the first index whose running sum reaches it. A zero-probability entry adds
    # nothing to the sum, so the point never falls on it, and the last sum is the total, so one is found.
    uniform = 1.0 - torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    return torch.searchsorted(cumulative, uniform * cumulative[:, -1:]).squeeze(-1)


def _truncated_probs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities renormalised over the top-k / top-p set (at least the most likely token survives)."""
    if params.top_k <= 0 and params.top_p >= 1.0:
        return logprobs.exp()
    kept = logprobs
    if params.top_k > 0 and params.top_k < logprobs.shape[-1]:
        kth = torch.topk(logprobs, params.top_k, dim=-1).values[..., -1:]
        kept = kept.masked_fill(kept < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(kept, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        kept = kept.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.softmax(kept, dim=-1)
