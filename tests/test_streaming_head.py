"""The streamed language-model head (``roll.strategies.streaming_head``): the response logprobs, entropies
and distillation terms equal the materialised logits' in value and in every gradient, while no tensor as
large as the logits of all positions is kept for the backward pass. ``benchmarks/train_memory.py``
measures the memory it saves at a 152k vocabulary."""

from __future__ import annotations

import pytest
import torch

import roll.algorithms.functional as functional
import roll.strategies.hf_forward as hf_forward
from roll.data.batch import Batch
from roll.models.loading import load_causal_lm
from roll.strategies.hf_forward import response_logprobs
from roll.strategies.streaming_head import streamable_head, streamed_scores
from roll.workers.actor_losses import DistillLossSpec, distill_terms


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 rows of the tiny model's vocabulary, so every pass here runs over several chunks."""
    monkeypatch.setattr(functional, "_LOGIT_CHUNK_ELEMENTS", 2 * 32)


def ragged_batch(vocab: int, rows: int = 3) -> Batch:
    generator = torch.Generator().manual_seed(0)
    return Batch(
        tensors={
            "prompt_ids": torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9], [0, 0, 0, 0, 9]])[:rows],
            "prompt_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])[:rows],
            "response_ids": torch.randint(4, vocab, (rows, 6), generator=generator),
            "response_mask": torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])[
                :rows
            ],
        }
    )


def logprob_pass(model: torch.nn.Module, batch: Batch, streamed: bool, monkeypatch: pytest.MonkeyPatch):
    """Logprobs, entropies and every parameter's gradient of a loss weighing both (random weights)."""
    with monkeypatch.context() as patch:
        if not streamed:
            patch.setattr(hf_forward, "streamable_head", lambda model: None)
        model.zero_grad()
        logprobs, entropy = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
        generator = torch.Generator().manual_seed(1)
        weights = (
            torch.randn(logprobs.shape, generator=generator),
            torch.randn(logprobs.shape, generator=generator),
        )
        ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("kernel", ["sdpa", "sdpa_varlen"], ids=["padded", "packed"])
def test_streamed_logprobs_entropies_and_gradients_equal_the_materialised_logits(
    tiny_model_path: str, kernel: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_causal_lm(tiny_model_path, attn_implementation=kernel)
    assert streamable_head(model) is model.lm_head
    batch = ragged_batch(model.config.vocab_size)
    streamed, materialised = (logprob_pass(model, batch, on, monkeypatch) for on in (True, False))
    torch.testing.assert_close(streamed[0], materialised[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(streamed[1], materialised[1], atol=1e-6, rtol=1e-5)
    # The tiny model ties its head to the embeddings: that gradient holds the head's part too.
    assert streamed[2].keys() == materialised[2].keys() and "model.embed_tokens.weight" in streamed[2]
    for name, grad in materialised[2].items():
        torch.testing.assert_close(streamed[2][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert (streamed[0][batch["response_mask"] == 0] == 0).all()


def test_no_logits_beyond_a_chunk_are_kept_for_backward(tiny_model_path: str, small_chunks: None) -> None:
    model = load_causal_lm(tiny_model_path)
    vocab = model.config.vocab_size
    batch = ragged_batch(vocab)  # 12 response tokens, 2 rows to a chunk
    kept: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = response_logprobs(model, batch, with_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    logits_kept = [shape for shape in kept if shape[-1] == vocab and shape != (vocab,)]
    assert kept and not logits_kept, logits_kept  # the materialised path keeps [1, 12, vocab] here
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_streamed_scores_match_autograd_with_a_bias_and_a_frozen_weight(small_chunks: None) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=generator, requires_grad=True)
    weight = torch.randn(32, 5, generator=generator)  # frozen, as a LoRA base's head
    bias = torch.randn(32, generator=generator, requires_grad=True)
    targets = torch.randint(0, 32, (7,), generator=generator)
    upstream = torch.randn(7, 2, generator=generator)

    def score(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(logits, -1)
        return torch.stack([logprobs.gather(-1, ids[:, None])[:, 0], logprobs.max(-1).values], -1)

    streamed = streamed_scores(hidden, weight, bias, score, targets, temperature=1.3)
    (streamed * upstream).sum().backward()
    got = hidden.grad.clone(), bias.grad.clone()
    hidden.grad, bias.grad = None, None
    expected = score((hidden @ weight.T + bias) / 1.3, targets)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(streamed, expected.detach())
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], bias.grad)
    assert weight.grad is None


def test_streamed_distillation_terms_equal_the_materialised_ones(
    tiny_model_path: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_causal_lm(tiny_model_path)
    batch = ragged_batch(model.config.vocab_size)
    generator = torch.Generator().manual_seed(2)
    rows, width, k = *batch["response_ids"].shape, 3
    batch["teacher_indices"] = torch.stack(
        [torch.randperm(model.config.vocab_size, generator=generator)[:k] for _ in range(rows * width)]
    ).view(rows, width, k)
    batch["teacher_logprobs"] = torch.log_softmax(torch.randn(rows, width, k + 1, generator=generator), -1)
    spec = DistillLossSpec(objective="forward_kl", tail="extra_class", ce_weight=0.5)
    results = []
    for streamed in (True, False):
        with monkeypatch.context() as patch:
            if not streamed:
                patch.setattr(hf_forward, "streamable_head", lambda model: None)
            model.zero_grad()
            divergence, kl, logprobs, mask = distill_terms(model, batch, spec)
            (divergence.sum() + 0.5 * logprobs.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append(((divergence.detach(), kl.detach(), logprobs.detach(), mask), grads))
    (streamed_terms, streamed_grads), (terms, grads) = results
    for got, expected in zip(streamed_terms, terms):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(streamed_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_head_whose_logits_are_changed_after_it_does_not_stream(tiny_model_path: str) -> None:
    model = load_causal_lm(tiny_model_path)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's: applied to the head's output
    assert streamable_head(model) is None
    model.config.final_logit_softcapping = None
    assert streamable_head(model) is model.lm_head
