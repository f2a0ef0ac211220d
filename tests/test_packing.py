"""Padding-free forward passes: with a varlen attention kernel (FlashAttention's, or torch's as
``sdpa_varlen``) a micro-batch's rows go through the model as one packed row (position ids restarting at
each row), and every result equals the padded pass's. sdpa and eager take packed rows through a
block-diagonal mask, which is how some of these tests force the packed path on a CPU; ``sdpa_varlen`` runs
it as configured (one sdpa call per sequence on a CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from in_process_actor import Actor, weights

import roll.strategies.hf_forward as hf_forward
from roll.data.batch import Batch
from roll.models.loading import load_causal_lm, load_value_model
from roll.models.varlen_attention import sequence_starts
from roll.strategies.hf_forward import packs_sequences, response_logprobs, response_values


def ragged_batch(vocab: int) -> Batch:
    """Left-padded prompts and right-padded responses of different lengths: a third of the padded grid is
    padding."""
    torch.manual_seed(0)
    return Batch(
        tensors={
            "prompt_ids": torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9], [0, 0, 0, 0, 9]]),
            "prompt_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]),
            "response_ids": torch.randint(4, vocab, (3, 5)),
            "response_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]),
        }
    )


def model_inputs(model: torch.nn.Module) -> list[dict]:
    """What each forward of ``model`` receives (shapes, and whether a mask came)."""
    seen: list[dict] = []

    def record(module, args, kwargs) -> None:
        seen.append(
            {"ids": tuple(kwargs["input_ids"].shape), "mask": kwargs.get("attention_mask") is not None}
        )

    model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny_model_path: str, kernel: str) -> None:
    model = load_causal_lm(tiny_model_path, attn_implementation=kernel)
    batch = ragged_batch(model.config.vocab_size)
    seen = model_inputs(model)
    results = {}
    for packed in (False, True):
        model.zero_grad()
        found = hf_forward._response_outputs(model, batch, packed=packed)
        logprobs = found.place(hf_forward.logprobs_from_logits(found.outputs, found.targets, 0.7))
        entropy = found.place(hf_forward.entropy_from_logits(found.outputs, 0.7))
        (logprobs.sum() + entropy.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[packed] = logprobs.detach(), entropy.detach(), grads
    # Padded: 3 rows of 5 + 4 columns, with a mask. Packed: the 3 + 5 + 1 prompt and 2 + 1 + 3 response
    # tokens that predict something (the last response token predicts nothing), in one row, no mask.
    assert seen == [{"ids": (3, 9), "mask": True}, {"ids": (1, 9 + 9), "mask": False}]
    (padded, padded_entropy, padded_grads), (packed, packed_entropy, packed_grads) = (
        results[False],
        results[True],
    )
    assert packed.shape == padded.shape == (3, 5) and (packed[batch["response_mask"] == 0] == 0).all()
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy, padded_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_packed_values_equal_the_padded_ones(tiny_model_path: str) -> None:
    model = load_value_model(tiny_model_path)
    torch.nn.init.normal_(model.score.weight)  # a fresh head is all zeros
    batch = ragged_batch(model.config.vocab_size)
    with torch.no_grad():
        padded = hf_forward._response_outputs(model, batch, packed=False)
        packed = hf_forward._response_outputs(model, batch, packed=True)
        padded_values = padded.place(padded.outputs[..., 0].float())
        packed_values = packed.place(packed.outputs[..., 0].float())
    assert packed.outputs.shape[:2] == (1, int(batch["response_mask"].sum()))
    assert padded_values.abs().sum() > 0
    torch.testing.assert_close(packed_values, padded_values, atol=1e-5, rtol=1e-5)


def test_only_a_varlen_attention_kernel_packs() -> None:
    def model_with(kernel: str) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=kernel))

    assert all(
        map(packs_sequences, map(model_with, ["flash_attention_2", "flash_attention_3", "sdpa_varlen"]))
    )
    # sdpa and eager would attend through a mask as long as the whole pack: they stay padded.
    assert not packs_sequences(model_with("sdpa")) and not packs_sequences(model_with("eager"))


def test_a_packed_actor_trains_as_the_padded_one(tiny_model_path: str, sft_batch: Batch) -> None:
    """Two SFT steps of the real actor, padded (sdpa) and packed (``model.attn_implementation:
    sdpa_varlen``): the same losses and weights. Its logprobs for the old policy agree too."""
    runs = {}
    for kernel in ("sdpa", "sdpa_varlen"):
        with Actor(
            tiny_model_path, "float32", lr=1e-2, model_changes={"attn_implementation": kernel}
        ) as actor:
            assert packs_sequences(actor.model) == (kernel == "sdpa_varlen")
            old = actor.compute_logprobs(sft_batch)["logprobs"]
            losses = [actor.train_step(sft_batch)["loss"] for _ in range(2)]
            runs[kernel] = old, losses, weights(actor)
    (old, losses, after), (old_packed, losses_packed, after_packed) = runs["sdpa"], runs["sdpa_varlen"]
    torch.testing.assert_close(old_packed, old, atol=1e-5, rtol=1e-5)
    assert losses_packed == pytest.approx(losses, rel=1e-5)
    assert losses[1] < losses[0]
    for name, tensor in after.items():
        torch.testing.assert_close(after_packed[name], tensor, atol=1e-5, rtol=1e-5)


def test_sdpa_varlen_attends_within_each_packed_sequence_with_no_mask(
    tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU ``sdpa_varlen`` runs one causal sdpa call per packed sequence: no mask as long as the
    pack, no compute on padding, and the padded model's logprobs and gradients."""
    import roll.models.varlen_attention as varlen_attention

    padded_model = load_causal_lm(tiny_model_path, attn_implementation="sdpa")
    model = load_causal_lm(tiny_model_path, attn_implementation="sdpa_varlen")
    batch = ragged_batch(model.config.vocab_size)
    seen = model_inputs(model)
    calls: list[tuple[int, ...]] = []
    sdpa = varlen_attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        varlen_attention.F,
        "scaled_dot_product_attention",
        lambda q, *a, **k: (q.shape[0] == 1 and calls.append(q.shape[2])) or sdpa(q, *a, **k),
    )
    results = {}
    for name, m in (("padded", padded_model), ("packed", model)):
        logprobs, entropy = response_logprobs(m, batch, temperature=0.7, with_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
        results[name] = logprobs.detach(), {n: p.grad for n, p in m.named_parameters()}
    assert seen == [{"ids": (1, 18), "mask": False}]
    # One call per row (one layer) over its 3 + 3, 5 + 2 and 1 + 4 attended tokens, each a batch of one
    # (sdpa's fused kernel: without a batch dimension a CPU takes the math path and holds [H, l, l]); the
    # padded model's one call over its three rows is not counted.
    assert calls == [6, 7, 5]
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-5, rtol=1e-5)
    for name, grad in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][name], grad, atol=1e-5, rtol=1e-4)


def test_sdpa_varlen_is_sdpa_for_padded_rows_and_cached_decoding(tiny_model_path: str) -> None:
    """What does not come packed (rows with padding; the rollout engine's prefill and decode with a KV
    cache) runs as sdpa does."""
    models = [load_causal_lm(tiny_model_path, attn_implementation=k) for k in ("sdpa", "sdpa_varlen")]
    batch = ragged_batch(models[0].config.vocab_size)
    prompt = {"input_ids": batch["prompt_ids"], "attention_mask": batch["prompt_mask"]}
    with torch.no_grad():
        logits = [m(**prompt).logits for m in models]
        generated = [m.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=0) for m in models]
    mask = batch["prompt_mask"].bool()
    torch.testing.assert_close(logits[1][mask], logits[0][mask])
    assert torch.equal(generated[1], generated[0])


def test_sdpa_varlen_refuses_to_pack_sliding_window_layers() -> None:
    """sdpa would attend across the packed sequences there: an error naming the option, not a wrong loss."""
    import roll.models.varlen_attention as varlen_attention

    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="sdpa_varlen does not pack a model with sliding-window"):
        varlen_attention.varlen_attention_forward(
            torch.nn.Module(),
            q,
            q,
            q,
            None,
            sliding_window=4,
            position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
        )
    from transformers import MistralConfig, Qwen2Config

    assert varlen_attention.has_sliding_window(MistralConfig())
    assert varlen_attention.has_sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=8))
    assert not varlen_attention.has_sliding_window(Qwen2Config())
    # Unpacked (a padding mask, or a KV cache), sliding windows are sdpa's to handle.
    out, _ = varlen_attention.varlen_attention_forward(
        torch.nn.Module(), q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool), sliding_window=4
    )
    assert out.shape == (1, 6, 2, 8)


def test_sdpa_varlen_refuses_a_sliding_window_model_at_load(tiny_model_path: str, tmp_path) -> None:
    import json
    import shutil

    path = shutil.copytree(tiny_model_path, tmp_path / "windowed")
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="sliding-window attention layers cannot be packed this way. Use sdpa"
    ):
        load_causal_lm(path, attn_implementation="sdpa_varlen")
    load_causal_lm(path, attn_implementation="sdpa")  # the model itself loads


def test_packed_sequences_start_where_positions_restart() -> None:
    assert sequence_starts(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist() == [0, 3, 5, 6]
    assert sequence_starts(torch.tensor([[4, 5, 6]])).tolist() == [0, 3]  # one sequence, offset


def test_response_logprobs_pack_on_their_own_under_a_packing_kernel(
    tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_causal_lm(tiny_model_path)
    batch = ragged_batch(model.config.vocab_size)
    seen = model_inputs(model)
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch)
        monkeypatch.setattr(hf_forward, "packs_sequences", lambda model: True)
        packed, _ = response_logprobs(model, batch)
        values = response_values(model, batch)  # any model: the first logit as a "value"
    assert [s["mask"] for s in seen] == [True, False, False]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    assert values.shape == (3, 5)
