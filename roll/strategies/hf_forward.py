"""Teacher-forced forward passes over (prompt, response) batches with a Hugging Face causal LM.

Batch layout used across ROLL: ``prompt_ids``/``prompt_mask`` [B, P] left-padded, ``response_ids``/
``response_mask`` [B, R] right-padded. Joined, real tokens are contiguous, so position ids follow from
the attention mask.
"""

from __future__ import annotations

import torch

from roll.algorithms.functional import entropy_from_logits, logprobs_from_logits
from roll.data.batch import Batch
from roll.data.padding import position_ids_from_mask


def response_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities [B, R] of the response tokens under ``model`` (logits divided by ``temperature``,
    as the sampler did), and their entropy [B, R] when asked. Positions past the response are 0."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    response_ids, response_mask = batch["response_ids"], batch["response_mask"]
    # Trailing all-padding response columns cost compute and change nothing: drop them, pad back after.
    full_length = response_ids.shape[1]
    length = int(response_mask.sum(dim=1).max().item()) if response_mask.numel() else 0
    length = max(length, 1)
    response_ids, response_mask = response_ids[:, :length], response_mask[:, :length]

    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = position_ids_from_mask(attention_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    # The token at position t is predicted by the logits at t-1.
    prompt_length = prompt_ids.shape[1]
    logits = logits[:, prompt_length - 1 : prompt_length - 1 + length].float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, response_ids) * response_mask
    entropy = entropy_from_logits(logits) * response_mask if with_entropy else None

    pad = full_length - length
    if pad:
        logprobs = torch.nn.functional.pad(logprobs, (0, pad))
        entropy = torch.nn.functional.pad(entropy, (0, pad)) if entropy is not None else None
    return logprobs, entropy
