"""Tiny vision-language models (Qwen2-VL): the tokenizer's vision tokens and list contents, the saved
directory loaded back by plain transformers and by ``roll.models.loading``, and the shape checks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from roll.config import TinyModelConfig, TinyVisionConfig
from roll.config.common import ModelConfig
from roll.config.validation import check_tiny_model
from roll.models.loading import (
    check_model_path,
    is_vision_language,
    load_causal_lm,
    load_image_processor,
    load_tokenizer,
)
from roll.models.tiny import (
    PROCESSOR_CONFIG_FILE,
    TINY_CONFIG_FILE,
    build_tiny_image_processor,
    build_tiny_model,
    mrope_section,
    save_tiny_model,
)
from roll.models.tokenizer import (
    IMAGE_PAD_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    VISION_TOKENS,
    build_char_tokenizer,
)

ALPHABET = "0123456789+= ab<|>"  # <, | and > too: a vision token must still be one id, never its characters
TEXT = TinyModelConfig(
    alphabet=ALPHABET,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
VLM = dataclasses.replace(TEXT, vision=TinyVisionConfig(depth=1, embed_dim=16, num_heads=2, image_size=56))
IMAGE_PROMPT = [
    {"role": "system", "content": [{"type": "text", "text": "ab"}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "1+2="}]},
]


@pytest.fixture(scope="module")
def saved_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny Qwen2-VL saved to disk, shared by the read-only tests."""
    return save_tiny_model(VLM, tmp_path_factory.mktemp("models") / "vlm")


@pytest.fixture(scope="module")
def saved_text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(TEXT, tmp_path_factory.mktemp("models") / "text")


def image_inputs(path: Path) -> dict[str, torch.Tensor]:
    """An image prompt as a Qwen2-VL processor would make it: the rendered template's one image token
    expanded to one copy per merged patch, pixel values from the saved image processor."""
    tokenizer, processor = load_tokenizer(path), load_image_processor(path)
    pixels = processor(images=[Image.new("RGB", (60, 30), (200, 30, 10))], return_tensors="pt")
    text = tokenizer.apply_chat_template(IMAGE_PROMPT, tokenize=False, add_generation_prompt=True)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
    copies = int(pixels["image_grid_thw"].prod()) // 4
    ids = []
    for token in tokenizer(text)["input_ids"]:
        ids += [token] * copies if token == image_id else [token]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": (input_ids == image_id).int(),
    }


# --- tokenizer and template --------------------------------------------------------------------------


def test_vision_tokens_come_after_every_text_id_and_never_split(saved_vlm: Path) -> None:
    text, vision = build_char_tokenizer(ALPHABET), build_char_tokenizer(ALPHABET, vision=True)
    assert {t: i for t, i in vision.get_vocab().items() if t not in VISION_TOKENS} == text.get_vocab()
    ids = vision.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == list(range(len(text), len(text) + len(VISION_TOKENS)))
    for tokenizer in (vision, load_tokenizer(saved_vlm)):  # as built and as transformers loads it back
        assert tokenizer(f"1{IMAGE_PAD_TOKEN}{IMAGE_PAD_TOKEN}a")["input_ids"] == [
            tokenizer.convert_tokens_to_ids("1"),
            ids[2],
            ids[2],
            tokenizer.convert_tokens_to_ids("a"),
        ]
        assert [tokenizer(token)["input_ids"] for token in VISION_TOKENS] == [[i] for i in ids]
    assert text(IMAGE_PAD_TOKEN)["input_ids"] != [ids[2]]  # a text tokenizer has no such token


def test_template_renders_list_contents_and_strings_as_before() -> None:
    tokenizer = build_char_tokenizer(ALPHABET, vision=True)
    messages = [
        *IMAGE_PROMPT,
        {"role": "assistant", "content": "3"},
        {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
    ]
    image = f"{VISION_START_TOKEN}{IMAGE_PAD_TOKEN}{VISION_END_TOKEN}"
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        f"<|system|>ab<|user|>{image}1+2=<|assistant|>3<|eos|>"
        f"<|user|><tool_response>a{image}</tool_response><|assistant|>"
    )
    as_strings = [{"role": "system", "content": "ab"}, {"role": "user", "content": "1+2="}]
    as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in as_strings]
    rendered = tokenizer.apply_chat_template(as_strings, tokenize=False)
    assert rendered == "<|system|>ab<|user|>1+2=" == tokenizer.apply_chat_template(as_parts, tokenize=False)
    with pytest.raises(Exception, match="unknown content part type: video"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], tokenize=False)


# --- the saved model ---------------------------------------------------------------------------------


def test_saved_directory_is_what_transformers_loads(saved_vlm: Path) -> None:
    check_model_path(saved_vlm)
    assert is_vision_language(saved_vlm)
    processor_config = json.loads((saved_vlm / PROCESSOR_CONFIG_FILE).read_text())
    assert processor_config == {"processor_class": "Qwen2VLProcessor"}
    preprocessor = json.loads((saved_vlm / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"  # torchvision's where installed
    assert (saved_vlm / "chat_template.jinja").is_file()
    config = json.loads((saved_vlm / "config.json").read_text())
    tokenizer = load_tokenizer(saved_vlm)
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
    assert config["vision_config"]["hidden_size"] == config["text_config"]["hidden_size"] == VLM.hidden_size
    assert sum(config["text_config"]["rope_parameters"]["mrope_section"]) == VLM.hidden_size // 4 // 2


def test_saved_model_loads_with_equal_weights_and_logits(saved_vlm: Path) -> None:
    from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration

    plain = AutoModelForImageTextToText.from_pretrained(str(saved_vlm), local_files_only=True).eval()
    ours = load_causal_lm(saved_vlm).eval()
    built = build_tiny_model(VLM, build_char_tokenizer(ALPHABET, vision=True)).eval()
    assert isinstance(ours, Qwen2VLForConditionalGeneration) and ours.dtype == torch.float32
    assert ours.lm_head.weight.data_ptr() == ours.get_input_embeddings().weight.data_ptr()  # tied
    assert ours.generation_config.eos_token_id == load_tokenizer(saved_vlm).eos_token_id
    weights = plain.state_dict()
    for name, tensor in [*ours.state_dict().items(), *built.state_dict().items()]:
        assert torch.equal(tensor, weights[name]), name
    inputs = image_inputs(saved_vlm)
    assert int(inputs["mm_token_type_ids"].sum()) == 2  # 60x30 pixels -> 56x28 -> 4x2 patches -> 2 tokens
    with torch.no_grad():
        expected = plain(**inputs).logits
        assert torch.equal(ours(**inputs).logits, expected)
        assert torch.equal(built(**inputs).logits, expected)
        # The image is read: another one changes the logits.
        other = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
        assert not torch.allclose(ours(**other).logits, expected)


def test_image_processor_bounds_the_image_size(saved_vlm: Path) -> None:
    processor = load_image_processor(saved_vlm)
    assert processor.to_dict() | {"image_processor_type": None} == (
        build_tiny_image_processor(VLM.vision).to_dict() | {"image_processor_type": None}
    )
    for size in [(20, 10), (500, 400)]:
        grid = processor(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"][0]
        height, width = int(grid[1]) * 14, int(grid[2]) * 14
        assert 28 * 28 <= height * width <= VLM.vision.image_size**2


def test_a_text_model_is_not_vision_language(saved_text_model: Path, tmp_path: Path) -> None:
    from transformers import Qwen2ForCausalLM

    assert not is_vision_language(saved_text_model)
    assert load_image_processor(saved_text_model) is None
    assert not (saved_text_model / PROCESSOR_CONFIG_FILE).exists()
    assert isinstance(load_causal_lm(saved_text_model), Qwen2ForCausalLM)
    assert not is_vision_language(tmp_path)  # no config at all


def test_saving_twice_does_not_rebuild_and_a_new_tower_does(saved_vlm: Path, tmp_path: Path) -> None:
    path = save_tiny_model(VLM, tmp_path / "vlm")

    def stamp() -> list[int]:
        return [(path / name).stat().st_mtime_ns for name in (TINY_CONFIG_FILE, "model.safetensors")]

    built = stamp()
    assert json.loads((path / TINY_CONFIG_FILE).read_text())["vision"] == dataclasses.asdict(VLM.vision)
    save_tiny_model(dataclasses.replace(VLM, vision=dataclasses.replace(VLM.vision)), path)  # an equal config
    assert stamp() == built
    deeper = dataclasses.replace(VLM, vision=dataclasses.replace(VLM.vision, depth=2))
    save_tiny_model(deeper, path)
    assert json.loads((path / TINY_CONFIG_FILE).read_text())["vision"]["depth"] == 2
    save_tiny_model(TEXT, path)  # a text config replaces the vision-language build
    assert not is_vision_language(path) and not (path / PROCESSOR_CONFIG_FILE).exists()


# --- shape checks --------------------------------------------------------------------------------------


def test_mrope_section_splits_half_the_head() -> None:
    assert mrope_section(128) == [16, 24, 24]  # Qwen2-VL's own
    for head_dim in range(6, 130, 2):
        section = mrope_section(head_dim)
        assert sum(section) == head_dim // 2 and min(section) > 0, head_dim
    for head_dim in (4, 7):
        with pytest.raises(ValueError, match="M-RoPE"):
            mrope_section(head_dim)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 3}, "vision.embed_dim (16) must be divisible by model.tiny.vision.num_heads (3)"),
        ({"embed_dim": 12}, "vision heads' width, embed_dim / num_heads (6), must be a multiple of 4"),
        ({"image_size": 50}, "model.tiny.vision.image_size (50) must be a multiple of 28"),
        ({"hidden_size": 16, "num_attention_heads": 4}, "text heads' width"),
        ({"hidden_size": 36, "num_attention_heads": 4}, "(9), must be even"),
    ],
)
def test_check_tiny_model_refuses_a_bad_vision_shape(change: dict, message: str) -> None:
    text_fields = {k: v for k, v in change.items() if k in ("hidden_size", "num_attention_heads")}
    vision = dataclasses.replace(VLM.vision, **{k: v for k, v in change.items() if k not in text_fields})
    tiny = dataclasses.replace(VLM, vision=vision, **text_fields)
    problems = check_tiny_model(ModelConfig(tiny=tiny))
    assert any(message in problem for problem in problems), problems
    assert check_tiny_model(ModelConfig(tiny=VLM)) == []
    assert check_tiny_model(ModelConfig(tiny=dataclasses.replace(tiny, vision=None))) == []
