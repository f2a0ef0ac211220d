"""Teacher-forced forward passes over (prompt, response) batches with a Hugging Face causal LM.

Batch layout used across ROLL: ``prompt_ids``/``prompt_mask`` [B, P] left-padded, ``response_ids``/
``response_mask`` [B, R] right-padded, ``response_mask`` being the response's part of the attention mask
(``roll.data.masks``: the tokens trained on are a separate ``loss_mask``). Joined, attended tokens are
contiguous, so position ids follow from the attention mask. Outputs are masked by the attention mask;
callers weigh them with the loss mask.
"""

from __future__ import annotations

import inspect

import torch

from roll.algorithms.functional import entropy_from_logits, logprobs_from_logits
from roll.data.batch import Batch
from roll.data.masks import last_index
from roll.data.padding import position_ids_from_mask


def _response_outputs(
    model: torch.nn.Module, batch: Batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``model`` on prompt + response; returns the per-position outputs [B, L, ...] that *predict* each
    response token (position t-1 for token t), with the response ids and mask cut to that length L.

    Response columns after the last attended one cost compute and change nothing, so they are dropped
    (found by index: a response mask with a hole keeps every column up to its end); callers pad their
    results back to the full width with ``_pad_to``."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    response_ids, response_mask = batch["response_ids"], batch["response_mask"]
    length = int(last_index(response_mask).max().item()) + 1 if response_mask.numel() else 0
    length = max(length, 1)
    response_ids, response_mask = response_ids[:, :length], response_mask[:, :length]

    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = position_ids_from_mask(attention_mask)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    prompt_length = prompt_ids.shape[1]
    predicting = slice(prompt_length - 1, prompt_length - 1 + length)  # position t-1 predicts token t
    if forward_takes(model, "logits_to_keep"):
        # The head runs on those positions alone, into a contiguous [B, L, V]: the prompt's logits are never
        # made (at a 152k vocabulary, 0.3 MB a token in bf16), and no slice of them needs copying.
        positions = torch.arange(predicting.start, predicting.stop, device=input_ids.device)
        return model(**inputs, logits_to_keep=positions).logits, response_ids, response_mask
    return model(**inputs).logits[:, predicting], response_ids, response_mask


def forward_takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether ``model``'s forward (under a peft wrapper or not) takes ``argument``: e.g. transformers'
    causal LMs take ``logits_to_keep`` and a value model (token classification) does not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return argument in inspect.signature(base.forward).parameters


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    return (
        torch.nn.functional.pad(values, (0, width - values.shape[1])) if values.shape[1] < width else values
    )


def response_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities [B, R] of the response tokens under ``model`` (logits divided by ``temperature``,
    as the sampler did), and their entropy [B, R] when asked. Positions past the response are 0."""
    logits, response_ids, response_mask = _response_outputs(model, batch)
    # No float32 or temperature-scaled copy of the logits: the helpers do both a chunk of rows at a time.
    width = batch["response_ids"].shape[1]
    logprobs = logprobs_from_logits(logits, response_ids, temperature) * response_mask
    entropy = entropy_from_logits(logits, temperature) * response_mask if with_entropy else None
    return _pad_to(logprobs, width), _pad_to(entropy, width) if entropy is not None else None


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Values [B, R] from a value model (one scalar head per position, see ``load_value_model``): the
    value of the state *before* each response token, read where that token is predicted. 0 past the
    response."""
    outputs, _, response_mask = _response_outputs(model, batch)
    values = outputs[..., 0].float() * response_mask
    return _pad_to(values, batch["response_ids"].shape[1])


def sequence_logprobs(
    model: torch.nn.Module, token_ids: list[list[int]], pad_id: int = 0
) -> list[list[float]]:
    """Each token's log-probability given the tokens before it (temperature 1), for every token but
    the first of each sequence: what an engine calls prompt logprobs. Sequences are right-padded into one
    batch; the padding is masked and never scored."""
    from roll.data.padding import right_pad

    device = next(model.parameters()).device
    ids, mask = right_pad(token_ids, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logprobs = logprobs_from_logits(logits[:, :-1], ids[:, 1:]).cpu()
    return [logprobs[row, : len(seq) - 1].tolist() for row, seq in enumerate(token_ids)]


# A preference batch holds one row per pair: the prompt (``prompt_ids``/``prompt_mask``), the chosen
# completion as the response (``response_ids``/``response_mask``) and the rejected one beside it.
REJECTED_IDS, REJECTED_MASK = "rejected_ids", "rejected_mask"


def pair_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence log-probabilities [B] of each pair's chosen and rejected completions, and their token
    counts [B], from one forward pass over the 2B sequences (chosen rows, then rejected rows). The
    completion's every attended token counts (a preference completion has no environment tokens)."""
    width = max(batch["response_ids"].shape[1], batch[REJECTED_IDS].shape[1])
    both = Batch(
        tensors={
            "prompt_ids": torch.cat([batch["prompt_ids"]] * 2),
            "prompt_mask": torch.cat([batch["prompt_mask"]] * 2),
            "response_ids": torch.cat(
                [_pad_to(batch["response_ids"], width), _pad_to(batch[REJECTED_IDS], width)]
            ),
            "response_mask": torch.cat(
                [_pad_to(batch["response_mask"], width), _pad_to(batch[REJECTED_MASK], width)]
            ),
        }
    )
    logprobs, _ = response_logprobs(model, both, temperature)
    mask = both["response_mask"].to(logprobs.dtype)
    sums, counts = (logprobs * mask).sum(dim=1), mask.sum(dim=1)
    size = len(batch)
    return sums[:size], sums[size:], counts[:size], counts[size:]


def response_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits [B, L, V] that predict each response token, with the response ids and mask cut to the
    same L (the columns up to the last attended one; the caller cuts its own [B, R] tensors to L)."""
    return _response_outputs(model, batch)


def pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` [B, L, ...] with zeros appended along dim 1 up to ``width`` columns."""
    if values.shape[1] >= width:
        return values
    shape = (values.shape[0], width - values.shape[1], *values.shape[2:])
    return torch.cat([values, values.new_zeros(shape)], dim=1)
