"""A tiny Qwen2-VL served by the hf engine and scored by the trainer's forward: image prompts generate,
and the engine's logprobs of what it sampled are the trainer's, padded and packed (M-RoPE positions,
pixel values and grids travel with the sample; roll.strategies.vision)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from roll.config.common import TinyModelConfig, TinyVisionConfig
from roll.data.batch import Batch
from roll.data.images import IMAGES, ImagePrompts, ImageSource, VisionInputs
from roll.data.padding import left_pad
from roll.models.loading import load_causal_lm, load_image_processor, load_tokenizer
from roll.models.tiny import save_tiny_model
from roll.strategies.hf_forward import response_logprobs
from roll.strategies.infer.hf import HFEngine
from roll.strategies.requests import SamplingParams
from roll.strategies.vision import freeze_vision_tower, mrope_positions, vision_tower

TINY = TinyModelConfig(
    alphabet="0123456789 abcdefghijklmnopqrstuvwxyz?",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    vision=TinyVisionConfig(),
)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_model(TINY, tmp_path_factory.mktemp("vlm") / "model")


def picture(seed: int, size: tuple[int, int]) -> ImageSource:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand((*size, 3), generator=generator) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return ImageSource(data=out.getvalue())


def image_prompts(tokenizer, vision: ImagePrompts) -> tuple[list[list[int]], list]:
    """Four prompts: one image, two square images, two images of other shapes, and text only. A square
    image's 4 tokens take 2 positions, so the text after it runs 2 positions behind its index."""
    rows = [
        ([picture(0, (56, 56))], "what?"),
        ([picture(3, (56, 56)), picture(4, (56, 56))], "both?"),
        ([picture(1, (40, 56)), picture(2, (56, 28))], "and?"),
        ([], "text only"),
    ]
    ids, inputs = [], []
    for images, text in rows:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        raw = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        ids.append(
            vision.expand(raw, [vision.tokens_per_image(i) for i in images], "test") if images else raw
        )
        inputs.append(vision.inputs(images) if images else None)
    return ids, inputs


def sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its text attention's queries and keys scaled up: a random tiny model attends almost
    uniformly, so a wrong position would change nothing; this one's scores depend on every position."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "language_model" in name and ("q_proj" in name or "k_proj" in name):
                parameter.mul_(12.0)
    return model


def test_the_engine_samples_from_images_with_the_trainers_logprobs(vlm_dir):
    tokenizer = load_tokenizer(vlm_dir)
    vision = ImagePrompts(load_image_processor(vlm_dir), tokenizer)
    model = sharpened(load_causal_lm(vlm_dir))
    ids, inputs = image_prompts(tokenizer, vision)
    prompt_ids, prompt_mask = left_pad(ids, tokenizer.pad_token_id)
    batch = Batch(
        tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}, non_tensors={IMAGES: inputs}
    )
    engine = HFEngine(model, tokenizer)
    try:
        torch.manual_seed(0)
        generated = engine.generate(batch, SamplingParams(max_new_tokens=16, temperature=1.0))
    finally:
        engine.shutdown()
    scored = batch.union(generated)
    mask = scored["response_mask"].bool()
    # Sampled at temperature 1: the two-square-image row decodes many tokens at positions 4 behind its
    # index (a decode that forgot the offset would score them otherwise).
    _, offsets = mrope_positions(model, prompt_ids, prompt_mask, VisionInputs.concat(inputs))
    assert offsets.tolist() == [-2, -4, 0, 0] and mask[1].sum() >= 8, (offsets, mask.sum(dim=1))
    logprobs, _ = response_logprobs(model, scored)
    assert torch.allclose(logprobs[mask], scored["rollout_logprobs"][mask], atol=1e-5)

    packed_model = sharpened(load_causal_lm(vlm_dir, attn_implementation="sdpa_varlen"))
    packed, _ = response_logprobs(packed_model, scored)
    assert torch.allclose(packed[mask], logprobs[mask], atol=1e-5)

    # The pictures are read: the first row scored with another picture of its shape changes, alone.
    swapped = Batch(tensors=dict(scored.tensors), non_tensors=dict(scored.non_tensors))
    swapped[IMAGES] = [vision.inputs([picture(7, (56, 56))]), *inputs[1:]]
    changed, _ = response_logprobs(model, swapped)
    assert (changed[0] - logprobs[0])[mask[0]].abs().max() > 1e-4
    assert torch.allclose(changed[1:][mask[1:]], logprobs[1:][mask[1:]], atol=1e-6)


def test_the_vision_tower_freezes_and_a_text_model_has_none(vlm_dir, tmp_path):
    model = load_causal_lm(vlm_dir)
    tower = vision_tower(model)
    assert tower is not None and freeze_vision_tower(model) == sum(p.numel() for p in tower.parameters())
    assert not any(p.requires_grad for p in tower.parameters())
    text_weights = [p for name, p in model.named_parameters() if "visual" not in name]
    assert text_weights and all(p.requires_grad for p in text_weights)
    text_model = load_causal_lm(save_tiny_model(TinyModelConfig(), tmp_path / "text"))
    assert vision_tower(text_model) is None and freeze_vision_tower(text_model) == 0
