"""The language-model head computed a chunk of positions at a time, so that neither the logits nor their
gradient ever exist for all positions at once.

At a 152k vocabulary a position's logits take 0.3 MB in bf16 and their gradient as much again: at 32k
response tokens, 20 GB for the head alone. ``streamed_scores`` is one autograd function over the
hidden states and the head's weight. Its forward pass makes one chunk of rows' logits at a time, turns
them into a few numbers per position with a *score* function (the response token's logprob and the
entropy, a distillation student's distribution on the teacher's top-k, ...) and keeps only those. Its
backward pass makes each chunk's logits again and takes the score's gradient through them. What it keeps
for backward is the hidden states and the weight, which exist anyway.

``head_scores`` puts it inside the model's own forward pass by standing in for the head module's
``forward`` for one call: the head still runs under its module hooks, which is where FSDP2 gathers its
weight. ``streamable_head`` says which models can take it: a plain ``nn.Linear`` head and a causal LM
that leaves the head's output as it is (no soft-capping or scaling after it) and runs its head only on
``logits_to_keep``. Others materialise their logits as before (``roll.strategies.hf_forward``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.nn import functional as F

from roll.algorithms.functional import logit_chunk_rows

# A score: (chunk's logits in float32, divided by the temperature [r, V], the chunk's rows of each
# per-position tensor) -> [r, C] values for those rows.
Score = Callable[..., torch.Tensor]

# Config attributes of transformers' causal LMs whose forward changes the head's output after the head
# (Gemma 2's soft-capping, Cohere's logit_scale, Granite's logits_scaling): a streamed head would skip it.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def streamable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """``model``'s output head when its logits can be streamed (see the module docstring), else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, torch.nn.Linear):  # a peft-wrapped head, a value head, no head
        return None
    config = getattr(base, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING):
        return None
    from roll.strategies.hf_forward import forward_takes

    return head if forward_takes(model, "logits_to_keep") else None


class _StreamedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, score, temperature, *per_row):  # noqa: ANN001, ANN205
        lead = hidden.shape[:-1]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        per_row = [t.reshape(hidden.shape[0], *t.shape[len(lead) :]) for t in per_row]
        rows = logit_chunk_rows(weight.shape[0])
        out = [
            score(_logits(h, weight, bias, temperature), *parts)
            for h, *parts in zip(hidden.split(rows), *(t.split(rows) for t in per_row))
        ]
        ctx.save_for_backward(hidden, weight, bias, *per_row)
        ctx.score, ctx.temperature, ctx.rows, ctx.lead = score, temperature, rows, lead
        scores = torch.cat(out)
        # A copy, not a view (a few floats a position): FSDP2 warns of a module that returns a view.
        return scores.view(*lead, scores.shape[-1]).clone()

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        hidden, weight, bias, *per_row = ctx.saved_tensors
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if wants_hidden else None
        # Summed over chunks in float32, as one matmul over every row would: bf16 sums of hundreds of
        # chunks would round away the small ones.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_bias else None
        rows = ctx.rows
        grad_out = grad_out.reshape(hidden.shape[0], -1)
        chunks = zip(hidden.split(rows), grad_out.split(rows), *(t.split(rows) for t in per_row))
        for index, (h, g, *parts) in enumerate(chunks):
            with torch.enable_grad():
                logits = F.linear(h, weight, bias).detach().requires_grad_()
                scores = ctx.score(_scaled(logits, ctx.temperature), *parts)
                (grad_logits,) = torch.autograd.grad(scores, logits, g)
            if grad_hidden is not None:
                grad_hidden[index * rows : index * rows + len(h)] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t().float(), h.float())
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(*ctx.lead, hidden.shape[-1])
        return grad_hidden, grad_weight, grad_bias, None, None, *(None for _ in per_row)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def _logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    return _scaled(F.linear(h, weight, bias), temperature)


def streamed_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    score: Score,
    *per_row: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``score`` of the logits ``hidden @ weight.T + bias`` (float32, divided by ``temperature``) row by
    row: [..., C] for ``hidden`` [..., H], with the per-row tensors [..., ...] (the same leading dims)
    handed to it chunk by chunk.
    Differentiable in ``hidden``, ``weight`` and ``bias``; the logits exist a chunk of rows at a time
    (``logit_chunk_rows``), in the forward pass and in the backward."""
    return _StreamedHead.apply(hidden, weight, bias, score, temperature, *per_row)


@contextmanager
def head_scores(
    head: torch.nn.Linear, score: Score, *per_position: torch.Tensor, temperature: float = 1.0
) -> Iterator[None]:
    """Inside the block, ``head`` returns ``score``'s values [..., C] instead of logits [..., V]: for the
    one forward pass whose kept positions are laid out as ``per_position``'s leading dims (the response
    ids they predict, and whatever else ``score`` reads)."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lead = hidden.shape[:-1]
        for tensor in per_position:
            if tensor.shape[: len(lead)] != lead:
                raise ValueError(
                    f"the head ran on positions {tuple(lead)} but their scores were laid out for "
                    f"{tuple(tensor.shape[: len(lead)])}"
                )
        return streamed_scores(hidden, head.weight, head.bias, score, *per_position, temperature=temperature)

    # An instance attribute shadows the class's forward; the module's hooks (FSDP2's) still run around it.
    head.forward = forward
    try:
        yield
    finally:
        del head.forward
