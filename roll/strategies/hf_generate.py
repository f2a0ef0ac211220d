"""Batch generation with Hugging Face ``generate``: token ids, per-token logprobs and finish reasons."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList

from roll.data.batch import Batch
from roll.strategies.hf_forward import batch_vision
from roll.strategies.requests import SamplingParams
from roll.strategies.vision import check_images_given, image_token_types, placeholder_ids, vision_arguments


class _SampledLogprobs(LogitsProcessor):
    """Records, step by step, the logprob of each sampled token under ``softmax(logits / temperature)``.

    ``generate`` runs user processors before its own warpers (temperature, top-k, top-p), so this sees
    the raw logits. The token a step samples is only known at the next call (the last column of
    ``input_ids``) or after ``generate`` returns (``finish``), so one step's log-softmax is kept until
    then: memory is one [B, V] tensor whatever the response length, where keeping every step's logits
    ([B, T, V]) needs about 40 GB for 64 x 1,024 tokens over a 152k vocabulary.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._resolve(input_ids[:, -1])
        scaled = scores.float() / self.temperature if self.temperature != 1.0 else scores.float()
        self.pending = torch.log_softmax(scaled, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] logprobs, given the tokens sampled at the last step."""
        self._resolve(last_tokens)
        return torch.stack(self.steps, dim=1).cpu() if self.steps else torch.zeros(last_tokens.shape[0], 0)

    def _resolve(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self.pending = None


@torch.no_grad()  # not inference_mode: FSDP writes its gathered weights in place
def generate(
    model: torch.nn.Module,
    batch: Batch,
    params: SamplingParams,
    eos_ids: int | Sequence[int],
    pad_id: int,
    tokenizer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
) -> Batch:
    """Sample one response per row of ``batch`` (``prompt_ids``/``prompt_mask`` left-padded).

    A response ends at the first of ``eos_ids`` (the model's end-of-sequence ids, see
    ``roll.models.loading.end_of_sequence_ids``) or of ``params.stop_token_ids``. Returns a Batch with
    ``response_ids``/``response_mask`` [B, max_new_tokens] (right-padded, the stop token included in the
    mask), ``rollout_logprobs`` [B, max_new_tokens] of the sampled tokens under the sampling temperature,
    and per-row ``finish_reason`` ("stop" or "length") and, with a tokenizer, ``response_text`` (special
    tokens removed).

    ``stopping_criteria`` are added to the EOS and length checks; a row they stop receives ``pad_id``
    from then on (the inference engine uses this to abort single requests).
    """
    device = next(model.parameters()).device
    stop_ids = list(
        dict.fromkeys([*([eos_ids] if isinstance(eos_ids, int) else eos_ids), *params.stop_token_ids])
    )
    prompt_ids, prompt_mask = batch["prompt_ids"].to(device), batch["prompt_mask"].to(device)
    # A fresh GenerationConfig: a model's own defaults (top_k=50, repetition penalty, ...) would silently
    # change the sampling distribution away from the one the trainer's logprobs describe.
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        do_sample=not params.greedy,
        temperature=None if params.greedy else params.temperature,
        top_p=None if params.greedy else params.top_p,
        top_k=None if params.greedy else params.top_k,
        suppress_tokens=list(placeholder_ids(model)) or None,  # as the engine and the trainer: never sampled
        return_dict_in_generate=True,
    )
    recorder = _SampledLogprobs(1.0 if params.greedy else params.temperature)
    # Sharded (FSDP) ranks all-gather weights in every forward, so all of them keep stepping until the
    # longest generation among them ends.
    synced = dist.is_initialized() and dist.get_world_size() > 1
    images = {}
    vision = batch_vision(batch)
    check_images_given(model, prompt_ids, vision)
    if vision is not None:  # transformers computes the M-RoPE positions from the token types itself
        images = vision_arguments(model, vision, device)
        images["mm_token_type_ids"] = image_token_types(model, prompt_ids)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        **images,
        generation_config=config,
        logits_processor=LogitsProcessorList([recorder]),
        stopping_criteria=stopping_criteria,
        synced_gpus=synced,
    )
    logprobs = recorder.finish(out.sequences[:, -1])
    new_tokens = out.sequences[:, prompt_ids.shape[1] :].cpu()

    is_eos = torch.isin(new_tokens, torch.tensor(stop_ids))
    # Keep tokens up to and including the first stop token; everything after it is padding.
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
