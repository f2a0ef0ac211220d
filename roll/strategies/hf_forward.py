"""Teacher-forced forward passes over (prompt, response) batches with a Hugging Face causal LM.

Batch layout used across ROLL: ``prompt_ids``/``prompt_mask`` [B, P] left-padded, ``response_ids``/
``response_mask`` [B, R] right-padded, ``response_mask`` being the response's part of the attention mask
(``roll.data.masks``: the tokens trained on are a separate ``loss_mask``). Joined, attended tokens are
contiguous, so position ids follow from the attention mask. Outputs are masked by the attention mask;
callers weigh them with the loss mask.

With a varlen attention kernel (``PACKING_KERNELS``) the rows of a micro-batch are packed into one row
without padding (position ids restart at each row's first token, and the kernel keeps the rows apart);
the results are laid out [B, R] as above either way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from roll.algorithms.functional import entropy_from_logits, logprobs_from_logits
from roll.data.batch import Batch
from roll.data.images import IMAGES, VisionInputs
from roll.data.masks import last_index
from roll.data.padding import position_ids_from_mask
from roll.strategies.sequence_parallel import sequence_group_of, split_pack
from roll.strategies.streaming_head import Score, head_scores, streamable_head
from roll.strategies.vision import (
    check_images_given,
    mrope_positions,
    placeholder_ids,
    vision_arguments,
    without_placeholders,
)

# Attention kernels that take packed rows without a mask over the whole pack: FlashAttention's varlen
# kernels, which transformers uses when position ids restart inside a row and no attention mask is given,
# and torch's own (``roll.strategies.varlen_attention``). sdpa and eager take packed rows too, but through
# a block-diagonal mask as long as the pack: they stay padded, since attention then costs the square of
# the pack's length.
PACKING_KERNELS = frozenset({"flash_attention_2", "flash_attention_3", "sdpa_varlen"})


def packs_sequences(model: torch.nn.Module) -> bool:
    """Whether forward passes over ``model`` pack each micro-batch's rows into one padding-free row: when
    its attention kernel is one of ``PACKING_KERNELS``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "_attn_implementation", None) in PACKING_KERNELS


@dataclass
class _ResponseOutputs:
    """The model's outputs at the positions that predict response tokens, and how to lay per-token results
    out as [B, R]."""

    outputs: torch.Tensor  # [B, L, ...] padded, or [1, N, ...] packed (N attended response tokens)
    targets: torch.Tensor  # the response ids predicted there: [B, L] or [1, N]
    # values [..., C?] per target -> [B, R, C?], 0 where not attended
    place: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class HeadScores:
    """What a streamed head computes at each kept position instead of logits (``streaming_head``):
    ``score(logits / temperature, response id, *per_position rows) -> [r, C]``, with ``per_position``
    tensors laid out [B, R, ...] beside ``response_ids``."""

    head: torch.nn.Linear
    score: Score
    per_position: tuple[torch.Tensor, ...] = ()
    temperature: float = 1.0


def _response_outputs(
    model: torch.nn.Module, batch: Batch, packed: bool | None = None, scores: HeadScores | None = None
) -> _ResponseOutputs:
    """Run ``model`` on prompt + response and keep its outputs at the positions that *predict* each
    response token (position t-1 for token t). With ``scores`` the head streams: the outputs are the
    scores [..., C], and no logits exist for all positions at once.

    Padded (sdpa, eager): [B, L, ...] over the response columns up to the last attended one. Columns after
    it cost compute and change nothing, so they are dropped (found by index: a response mask with a hole
    keeps every column up to its end). Packed (``packs_sequences``, or ``packed=True``): each row's attended
    tokens one after another in a single row with position ids restarting at 0, so no compute goes to
    padding; the outputs are [1, N, ...], one per attended response token."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    response_ids, response_mask = batch["response_ids"], batch["response_mask"]
    rows, width = response_ids.shape
    length = int(last_index(response_mask).max().item()) + 1 if response_mask.numel() else 0
    length = max(length, 1)
    response_ids, response_mask = response_ids[:, :length], response_mask[:, :length]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = position_ids_from_mask(attention_mask)
    prompt_length = prompt_ids.shape[1]
    options = {"use_cache": False} if forward_takes(model, "use_cache") else {}
    if packed is None:
        packed = packs_sequences(model)
    vision = batch_vision(batch)
    check_images_given(model, prompt_ids, vision)
    if vision is not None:
        options.update(vision_arguments(model, vision, input_ids.device))
        image_positions, _ = mrope_positions(model, input_ids, attention_mask, vision)

    if not packed:
        if torch.is_grad_enabled() and sequence_group_of(model) is not None:
            # Every rank of the group would run the whole batch: its gradient would count S times.
            raise ValueError("a sequence-parallel model trains on packed rows only (sdpa_varlen)")
        if vision is not None:
            position_ids = image_positions
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        predicting = torch.arange(prompt_length - 1, prompt_length - 1 + length, device=input_ids.device)
        with _streamed(scores, response_ids, lambda values: values[:, :length]):
            outputs = _forward_at(model, inputs, predicting, options)

        def place_padded(values: torch.Tensor) -> torch.Tensor:
            mask = response_mask.view(*response_mask.shape, *(1,) * (values.dim() - 2))
            return pad_columns(values * mask, width)

        return _ResponseOutputs(outputs, response_ids, place_padded)

    attended = attention_mask.bool()
    # A token's place in the pack (row-major over attended tokens); a response token is predicted by the
    # attended token just before it in its own row.
    packed_index = attended.flatten().cumsum(0).view_as(attended) - 1
    response_attended = attended[:, prompt_length:]
    predicting = packed_index[:, prompt_length:][response_attended] - 1
    inputs = {"input_ids": input_ids[attended][None], "position_ids": position_ids[attended][None]}
    if vision is not None:
        # [4, 1, N]: the text positions, which restart at each row (where the kernel splits the pack),
        # then the three M-RoPE positions the rotary embedding reads.
        text = inputs["position_ids"][None]
        inputs["position_ids"] = torch.cat([text, image_positions[:, attended][:, None]])
    targets = response_ids[response_attended][None]

    def kept(values: torch.Tensor) -> torch.Tensor:
        return values[:, :length][response_attended][None]

    group = sequence_group_of(model)
    if group is not None and vision is not None:
        raise ValueError("sequence parallelism does not take image prompts yet")
    if group is None:
        with _streamed(scores, targets, kept):
            outputs = _forward_at(model, inputs, predicting, options)
    else:  # this rank runs the model on its slice of the pack; every rank gets every kept output
        ids, positions, predicting, here, shard = split_pack(group, *inputs.values(), predicting)
        inputs = {"input_ids": ids, "position_ids": positions}
        with _streamed(scores, targets[:, here], lambda values: kept(values)[:, here]):
            outputs = _forward_at(model, inputs, predicting, {**options, "sequence_shard": shard})
        outputs = shard.gather(outputs)
    where = response_attended.nonzero(as_tuple=True)

    def place(values: torch.Tensor) -> torch.Tensor:
        laid_out = values.new_zeros((rows, width, *values.shape[2:]))
        return laid_out.index_put(where, values.reshape(-1, *values.shape[2:]))

    return _ResponseOutputs(outputs, targets, place)


def batch_vision(batch: Batch) -> VisionInputs | None:
    """The images of ``batch``'s rows, concatenated in row order (the order the model reads their
    placeholders in), or None when no row has any."""
    return VisionInputs.concat(batch[IMAGES]) if IMAGES in batch else None


def _streamed(
    scores: HeadScores | None, targets: torch.Tensor, kept: Callable[[torch.Tensor], torch.Tensor]
) -> object:
    """The head streaming ``scores`` for one forward pass (``kept`` lays [B, R, ...] tensors out as the
    kept positions are), or nothing."""
    if scores is None:
        return nullcontext()
    per_position = (kept(t.to(targets.device)) for t in scores.per_position)
    return head_scores(scores.head, scores.score, targets, *per_position, temperature=scores.temperature)


def _forward_at(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], positions: torch.Tensor, options: dict
) -> torch.Tensor:
    """``model``'s outputs [rows, len(positions), ...] at ``positions`` of its input."""
    if forward_takes(model, "logits_to_keep"):
        # The head runs on those positions alone, into a contiguous tensor: the prompt's logits are never
        # made (at a 152k vocabulary, 0.3 MB a token in bf16), and no slice of them needs copying.
        return model(**inputs, **options, logits_to_keep=positions).logits
    return model(**inputs, **options).logits[:, positions]


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
    as the sampler did), and their entropy [B, R] when asked. Positions past the response are 0.

    The head streams when the model allows (``streamable_head``): the logits never exist for all
    positions, in the forward pass or the backward."""
    head = streamable_head(model)
    unsampled = placeholder_ids(model)  # what the engines never sample (a VLM's image tokens)
    if head is not None:
        score = _logprob_and_entropy if with_entropy else _logprob
        if unsampled:
            score = partial(_scored_without, score, unsampled)
        found = _response_outputs(model, batch, scores=HeadScores(head, score, temperature=temperature))
        logprobs = found.place(found.outputs[..., 0])
        entropy = found.place(found.outputs[..., 1]) if with_entropy else None
        return _observed_pictures_zero(logprobs, batch, unsampled), entropy
    found = _response_outputs(model, batch)
    found.outputs = without_placeholders(found.outputs, unsampled, temperature)
    # No float32 or temperature-scaled copy of the logits: the helpers do both a chunk of rows at a time.
    logprobs = found.place(logprobs_from_logits(found.outputs, found.targets, temperature))
    entropy = found.place(entropy_from_logits(found.outputs, temperature)) if with_entropy else None
    return _observed_pictures_zero(logprobs, batch, unsampled), entropy


def _observed_pictures_zero(logprobs: torch.Tensor, batch: Batch, unsampled: tuple[int, ...]) -> torch.Tensor:
    """``logprobs`` with 0 at the placeholders of pictures an environment showed in the response: they are
    observations (never trained, as the engine's 0 there says), and their scores, with the placeholders
    given no probability, are the lowest float: a difference or a square of them would overflow."""
    if not unsampled:
        return logprobs
    ids = batch["response_ids"].to(logprobs.device)
    return logprobs.masked_fill(torch.isin(ids, torch.tensor(unsampled, device=ids.device)), 0.0)


def _scored_without(
    score: Score, unsampled: tuple[int, ...], logits: torch.Tensor, *rest: torch.Tensor
) -> torch.Tensor:
    return score(without_placeholders(logits, unsampled), *rest)


def _logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    picked = logits.gather(-1, targets.unsqueeze(-1))
    return picked - torch.logsumexp(logits, dim=-1, keepdim=True)


def _logprob_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = logits.gather(-1, targets.unsqueeze(-1)) - log_normalizer
    entropy = log_normalizer - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1, keepdim=True)
    return torch.cat([picked, entropy], dim=-1)


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Values [B, R] from a value model (one scalar head per position, see ``load_value_model``): the
    value of the state *before* each response token, read where that token is predicted. 0 past the
    response."""
    found = _response_outputs(model, batch)
    return found.place(found.outputs[..., 0].float())


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


def response_scores(
    model: torch.nn.Module, batch: Batch, score: Score, *per_position: torch.Tensor
) -> torch.Tensor | None:
    """``score(logits, response id, *per_position rows) -> [r, C]`` at each response position, by a
    streamed head: [B, R, C], 0 where not attended, with the per-position tensors laid out [B, R, ...].
    Packed when the model packs (and so sequence-parallel when it is). None when the model's head cannot
    stream."""
    head = streamable_head(model)
    if head is None:
        return None
    found = _response_outputs(model, batch, scores=HeadScores(head, score, per_position))
    return found.place(found.outputs)


def response_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [B, L, V] that predict each response token, with the response ids cut to the same L (the
    columns up to the last attended one; the caller cuts its own [B, R] tensors to L). Always padded:
    distillation's losses read the logits by row and column."""
    found = _response_outputs(model, batch, packed=False)
    return found.outputs, found.targets


def pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` [B, L, ...] with zeros appended along dim 1 up to ``width`` columns."""
    if values.shape[1] >= width:
        return values
    shape = (values.shape[0], width - values.shape[1], *values.shape[2:])
    return torch.cat([values, values.new_zeros(shape)], dim=1)
