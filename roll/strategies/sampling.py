"""The token sampler of ROLL's own engine (``SamplingParams`` is in ``roll.strategies.requests``)."""

from __future__ import annotations

import torch

from roll.strategies.requests import SamplingParams

# On a CPU, each [rows, V] float tensor above glibc's mmap threshold (32 MB at most) is fresh memory
# that the kernel zeroes page by page on every decode step: at 64 rows of a 151,936-token vocabulary
# that was two thirds of the sampler's time. Rows are sampled a few at a time, so each tensor stays
# small enough for the allocator to reuse.
_CPU_CHUNK_ENTRIES = 1 << 19


def sample_tokens(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [B, V] and return (tokens [B], logprobs [B] float32); see
    ``_sample_rows``. On a CPU, rows go a few at a time (``_CPU_CHUNK_ENTRIES``)."""
    rows = max(1, _CPU_CHUNK_ENTRIES // logits.shape[-1])
    if logits.device.type != "cpu" or logits.shape[0] <= rows:
        return _sample_rows(logits, params)
    parts = [_sample_rows(chunk, params) for chunk in logits.split(rows)]
    return torch.cat([tokens for tokens, _ in parts]), torch.cat([logprobs for _, logprobs in parts])


def _sample_rows(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
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


# Above this many entries per row, ``draw`` finds the block first: a float64 running sum over the whole row
# is two [B, V] tensors of 8-byte numbers a decode step (156 MB at 64 rows of 151,936 tokens).
_BLOCK = 1024


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` [B, V] (non-negative, each row's sum > 0), drawn with probability
    proportional to its entry: by inverse CDF, one uniform number per row from torch's global generator.

    ``torch.multinomial`` does the same but draws random numbers across the whole vocabulary, which
    made it most of a CPU decode step at a large vocabulary (docs/performance.md,
    benchmarks/generation_memory.py). The running sums are float64, so rounding cannot favour a token.
    A long row is searched in two levels, blocks of ``_BLOCK`` entries and then the entries of the block
    the point falls in: the same point and the same index as one running sum, without a float64 copy
    of the row."""
    rows, size = probs.shape
    uniform = 1.0 - torch.rand(rows, 1, dtype=torch.float64, device=probs.device)
    if size <= 2 * _BLOCK:
        cumulative = probs.double().cumsum(dim=-1)
        # A point in (0, total]; the first index whose running sum reaches it. A zero-probability entry
        # adds nothing to the sum, so the point never falls on it, and the last sum is the total.
        return torch.searchsorted(cumulative, uniform * cumulative[:, -1:]).squeeze(-1)
    blocks = -(-size // _BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * _BLOCK - size)) if size % _BLOCK else probs
    block_sums = padded.view(rows, blocks, _BLOCK).sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    point = uniform * block_sums[:, -1:]
    block = torch.searchsorted(block_sums, point).clamp(max=blocks - 1)  # a zero block is never chosen
    before = torch.where(block > 0, block_sums.gather(1, (block - 1).clamp(min=0)), 0.0)
    offsets = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    within = padded.gather(1, offsets).double().cumsum(dim=-1)
    # The two sums round differently: keep the point inside the block's own running sum, above zero, so
    # it lands on a positive entry of the block.
    rest = torch.minimum((point - before).clamp(min=torch.finfo(torch.float64).tiny), within[:, -1:])
    return (offsets.gather(1, torch.searchsorted(within, rest))).squeeze(-1)


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
