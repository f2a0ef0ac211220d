"""Batch generation with Hugging Face ``generate``: token ids, per-token logprobs and finish reasons."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import GenerationConfig, StoppingCriteriaList

from roll.algorithms.functional import logprobs_from_logits
from roll.data.batch import Batch
from roll.strategies.sampling import SamplingParams


@torch.no_grad()  # not inference_mode: FSDP writes its gathered weights in place
def generate(
    model: torch.nn.Module,
    batch: Batch,
    params: SamplingParams,
    eos_id: int,
    pad_id: int,
    tokenizer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
) -> Batch:
    """Sample one response per row of ``batch`` (``prompt_ids``/``prompt_mask`` left-padded).

    Returns a Batch with ``response_ids``/``response_mask`` [B, max_new_tokens] (right-padded, the EOS
    token included in the mask), ``rollout_logprobs`` [B, max_new_tokens] of the sampled tokens under the
    sampling temperature, and per-row ``finish_reason`` ("stop" or "length") and, with a tokenizer,
    ``response_text`` (special tokens removed).

    ``stopping_criteria`` are added to the EOS and length checks; a row they stop receives ``pad_id``
    from then on (the inference engine uses this to abort single requests).
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = batch["prompt_ids"].to(device), batch["prompt_mask"].to(device)
    # A fresh GenerationConfig: a model's own defaults (top_k=50, repetition penalty, ...) would silently
    # change the sampling distribution away from the one the trainer's logprobs describe.
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=not params.greedy,
        temperature=None if params.greedy else params.temperature,
        top_p=None if params.greedy else params.top_p,
        top_k=None if params.greedy else params.top_k,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # Sharded (FSDP) ranks all-gather weights in every forward, so all of them keep stepping until the
    # longest generation among them ends.
    synced = dist.is_initialized() and dist.get_world_size() > 1
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=config,
        stopping_criteria=stopping_criteria,
        synced_gpus=synced,
    )
    new_tokens = out.sequences[:, prompt_ids.shape[1] :].cpu()
    logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits [B, T, V], before any warper
    if not params.greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    logprobs = logprobs_from_logits(logits, new_tokens)

    is_eos = new_tokens == eos_id
    # Keep tokens up to and including the first EOS; everything after it is padding.
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    stopped = is_eos.any(dim=1)

    size, length = new_tokens.shape
    response_ids = torch.full((size, params.max_new_tokens), pad_id, dtype=torch.long)
    response_ids[:, :length] = torch.where(
        response_mask.bool(), new_tokens, torch.full_like(new_tokens, pad_id)
    )
    mask = torch.zeros((size, params.max_new_tokens), dtype=torch.long)
    mask[:, :length] = response_mask
    rollout_logprobs = torch.zeros((size, params.max_new_tokens), dtype=torch.float32)
    rollout_logprobs[:, :length] = logprobs * response_mask

    result = Batch(
        tensors={"response_ids": response_ids, "response_mask": mask, "rollout_logprobs": rollout_logprobs},
        non_tensors={"finish_reason": ["stop" if s else "length" for s in stopped.tolist()]},
    )
    if tokenizer is not None:
        result["response_text"] = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return result
