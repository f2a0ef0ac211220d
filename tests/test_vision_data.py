"""Image prompts at load: image columns as paths or bytes, content parts, the placeholders expanded once,
and every bad input refused naming the file and row (roll.data.images, roll.data.prompts)."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from roll.config.common import DataConfig, TinyVisionConfig
from roll.data.dataset import DatasetError
from roll.data.images import ImagePrompts
from roll.data.prompts import load_prompts
from roll.data.synthetic import shape_rows
from roll.models.tiny import build_tiny_image_processor
from roll.models.tokenizer import build_char_tokenizer

ALPHABET = "0123456789 abcdefghijklmnopqrstuvwxyz?"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET, vision=True)


@pytest.fixture(scope="module")
def vision(tokenizer) -> ImagePrompts:
    return ImagePrompts(build_tiny_image_processor(TinyVisionConfig()), tokenizer)


def data(**kwargs) -> DataConfig:
    return DataConfig(**{"max_prompt_length": 64, **kwargs})


def png(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_paths_relative_to_the_file_and_bytes_load_with_expanded_placeholders(tmp_path, tokenizer, vision):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png((56, 56)))
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "what colour?", "images": "pics/a.png", "answer": "red"},
            {"prompt": "plain text", "answer": "x"},
        ],
    )
    prompts = load_prompts(path, tokenizer, data(), vision=vision)
    image_token = vision.image_token_id
    assert prompts.token_ids[0].count(image_token) == 4  # 56x56: 16 patches, merged 2x2
    assert image_token not in prompts.token_ids[1] and prompts.vision_inputs(1) is None
    inputs = prompts.vision_inputs(0)
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4]] and inputs.pixel_values.shape[0] == 16
    assert prompts.rows[0]["prompt"] == "what colour?" and "images" not in prompts.rows[0]
    assert "what colour?" in prompts.texts[0] and vision.image_token in prompts.texts[0]

    rows = shape_rows(3, seed=1)  # parquet with PNG bytes, as `datasets` keeps an image column
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "shapes.parquet")
    shapes = load_prompts(str(tmp_path / "shapes.parquet"), tokenizer, data(), ["answer"], vision=vision)
    assert [shapes.token_ids[i].count(image_token) for i in range(3)] == [4, 4, 4]
    assert shapes.rows[2]["answer"] == rows[2]["answer"]


def test_a_conversation_places_its_images_where_its_parts_say(tmp_path, tokenizer, vision):
    (tmp_path / "wide.png").write_bytes(png((56, 28), (10, 200, 10)))
    (tmp_path / "tall.png").write_bytes(png((28, 56)))
    prompt = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "is"}, {"type": "image"}, {"type": "text", "text": "like"}],
        },
        {"role": "assistant", "content": "maybe"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": prompt, "images": ["wide.png", "tall.png"]}])
    prompts = load_prompts(path, tokenizer, data(), vision=vision)
    text = prompts.texts[0]
    assert text.index("is") < text.index(vision.image_token) < text.index("like")
    assert prompts.vision_inputs(0).image_grid_thw.tolist() == [[1, 2, 4], [1, 4, 2]]
    assert prompts.token_ids[0].count(vision.image_token_id) == 4  # 2 + 2 merged tokens


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "p", "images": "missing.png"}, "image 1 of 'images' is 'missing.png'"),
        ({"prompt": "p", "images": [b"not a picture"]}, "cannot be read as an image"),
        ({"prompt": "p", "images": []}, "empty list"),
        ({"prompt": "p", "images": 7}, "give a path, bytes"),
        (
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                "images": ["a.png"],
            },
            "2 image placeholder(s)",
        ),
        ({"prompt": [{"role": "user", "content": [{"type": "audio"}]}]}, "content part"),
    ],
)
def test_bad_image_rows_are_refused_naming_the_row(tmp_path, tokenizer, vision, row, expected):
    (tmp_path / "a.png").write_bytes(png((56, 56)))
    ok = {"prompt": "fine", "images": "a.png"}
    if isinstance(row.get("images"), list) and any(isinstance(v, bytes) for v in row["images"]):
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist([row, row]), path)
        where = f"{path} row 1"
    else:
        path = write_jsonl(tmp_path / "rows.jsonl", [ok, row])
        where = f"{path}:2"
    with pytest.raises(DatasetError) as raised:
        load_prompts(str(path), tokenizer, data(), vision=vision)
    assert where in str(raised.value) and expected in str(raised.value)


def test_images_need_a_vision_language_model_and_the_chat_template(tmp_path, tokenizer, vision):
    (tmp_path / "a.png").write_bytes(png((56, 56)))
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p"}, {"prompt": "p", "images": "a.png"}])
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: .*the model is text-only"):
        load_prompts(path, tokenizer, data())
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: .*apply_chat_template=true"):
        load_prompts(path, tokenizer, data(apply_chat_template=False), vision=vision)


def test_the_image_tokens_count_against_max_prompt_length(tmp_path, tokenizer, vision):
    (tmp_path / "a.png").write_bytes(png((56, 56)))
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "images": ["a.png", "a.png", "a.png"]}])
    text_only = load_prompts(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p"}]), tokenizer, data())
    length = len(text_only.token_ids[0]) + 3 * (2 + 4)  # per image: start, end and 4 image tokens
    assert (
        len(load_prompts(path, tokenizer, data(max_prompt_length=length), vision=vision).token_ids[0])
        == length
    )
    with pytest.raises(DatasetError, match="data.max_prompt_length"):
        load_prompts(path, tokenizer, data(max_prompt_length=length - 1), vision=vision)
