"""Tiny Qwen2 models with a character tokenizer, built from a config and saved in Hugging Face format.

Tests and the quickstart save the model to disk and load it back through `roll.models.loading`, so the
same loading path as for a real checkpoint is exercised without any network access. With a vision tower
(``cfg.vision``) the model is a Qwen2-VL, saved with its image processor and a ``processor_config.json``
so that ``AutoProcessor`` loads the directory where torchvision is installed (transformers builds
Qwen2-VL's processor only with it; ROLL itself uses the image processor and tokenizer directly).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch and transformers load in seconds: only building a model needs them
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Written last into a saved model directory: its presence marks the save complete, its content says
# which config built the model (so a later call with the same config can skip the rebuild).
TINY_CONFIG_FILE = "roll_tiny_config.json"
# Where a pipeline builds its tiny model, inside the run's output directory.
TINY_MODEL_DIR = "tiny_model"
# The class transformers' AutoTokenizer builds for a Qwen2 directory, which the tokenizer is built as.
TOKENIZER_CLASS = "Qwen2Tokenizer"

# Qwen2-VL's image geometry: 14-pixel patches, two frames a patch (an image is repeated), and 2x2 patches
# merged into one token of the text model, so image sides are multiples of IMAGE_SIDE_FACTOR pixels.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
IMAGE_SIDE_FACTOR = PATCH_SIZE * MERGE_SIZE
# What AutoProcessor reads to build a Qwen2VLProcessor from the image processor and tokenizer beside it.
PROCESSOR_CONFIG_FILE = "processor_config.json"
PROCESSOR_CLASS = "Qwen2VLProcessor"


class TinyVisionSpec(Protocol):
    """The vision tower of a tiny Qwen2-VL (``roll.config.TinyVisionConfig`` is one)."""

    depth: int
    embed_dim: int
    num_heads: int
    image_size: int


class TinyModelSpec(Protocol):
    """The shape of a tiny model: a dataclass with these fields (``roll.config.TinyModelConfig`` is one).
    Declared here so that the model layer does not import the config; it must be a dataclass because
    its fields, as ``dataclasses.asdict`` gives them, are stored with the model to recognise a rebuild."""

    alphabet: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seed: int

    @property
    def vision(self) -> TinyVisionSpec | None:
        """The vision tower, or None for a text-only model (read-only here, so any dataclass field fits)."""
        ...


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's M-RoPE split of a head's ``head_dim // 2`` rotary frequencies into temporal, height and
    width parts, in Qwen2-VL's own proportions (1/4, 3/8, 3/8: [16, 24, 24] for its head_dim of 128).

    Raises:
        ValueError: ``head_dim`` is odd or below 6 (each of the three parts needs a frequency).
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"M-RoPE needs an even head_dim of at least 6 (got {head_dim})")
    half = head_dim // 2
    spatial = 3 * half // 8  # >= 1 from half = 3 on
    return [half - 2 * spatial, spatial, spatial]


def build_tiny_model(cfg: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised float32 model sized by ``cfg``, with embeddings tied to the head: a Qwen2
    causal LM, or with ``cfg.vision`` a Qwen2-VL (``Qwen2VLForConditionalGeneration``) whose tokenizer
    must have been built with ``vision=True``.

    Initialisation is seeded by ``cfg.seed`` inside a forked RNG, so the same config always gives the
    same weights and the caller's global torch RNG state is left untouched.
    """
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2VLForConditionalGeneration

    if cfg.vision is None:
        config, model_class = _text_config(cfg, tokenizer), Qwen2ForCausalLM
    else:
        config = _vision_language_config(cfg, cfg.vision, tokenizer)
        model_class = Qwen2VLForConditionalGeneration
    # devices=[]: CPU RNG only; forking CUDA RNGs would initialise CUDA for no benefit.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_class(config)
    model = model.to(torch.float32)
    # `generate` reads its stop and pad ids from here, not from the model config.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _text_config(cfg: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_text_fields(cfg, tokenizer))


def _text_fields(cfg: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The text model's config fields: a Qwen2 config's, and a Qwen2-VL config's ``text_config``."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        dtype="float32",
    )


def _vision_language_config(
    cfg: TinyModelSpec, vision: TinyVisionSpec, tokenizer: PreTrainedTokenizerBase
) -> Any:
    """A Qwen2-VL config: ``cfg``'s text model with M-RoPE, and a vision tower whose merger projects into
    the text model's width (so the vision ``hidden_size`` is the text one)."""
    from transformers import Qwen2VLConfig

    from roll.models.tokenizer import IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN

    ids = {}
    for key, token in (
        ("image_token_id", IMAGE_PAD_TOKEN),
        ("video_token_id", VIDEO_PAD_TOKEN),
        ("vision_start_token_id", VISION_START_TOKEN),
        ("vision_end_token_id", VISION_END_TOKEN),
    ):
        ids[key] = tokenizer.convert_tokens_to_ids(token)
        if ids[key] is None or ids[key] == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token}; build it with build_char_tokenizer(vision=True)")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    text = _text_fields(cfg, tokenizer)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": mrope_section(head_dim),
    }
    tower = dict(
        depth=vision.depth,
        embed_dim=vision.embed_dim,
        hidden_size=cfg.hidden_size,
        num_heads=vision.num_heads,
        mlp_ratio=2,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        in_channels=3,
    )
    return Qwen2VLConfig(
        text_config=text, vision_config=tower, tie_word_embeddings=True, dtype="float32", **ids
    )


def build_tiny_image_processor(vision: TinyVisionSpec) -> Any:
    """The image processor a tiny Qwen2-VL is saved with: Qwen2-VL's, PIL-backed (it needs no torchvision),
    resizing each image to between 28x28 and ``image_size`` x ``image_size`` pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=IMAGE_SIDE_FACTOR**2,
        max_pixels=vision.image_size**2,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )


def _config_json(cfg: TinyModelSpec) -> dict:
    """The config as plain JSON data, the form stored in ``TINY_CONFIG_FILE``. An unset ``vision`` is left
    out, so a text model saved before the field existed is still recognised."""
    data = json.loads(json.dumps(dataclasses.asdict(cfg)))
    if data.get("vision") is None:
        data.pop("vision", None)
    return data


def _stored_config(path: Path) -> dict | None:
    """The config that built the tiny model saved at ``path``, or None when there is none (or unreadable)."""
    try:
        return json.loads((path / TINY_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _saved_tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _is_built_from(path: Path, cfg: TinyModelSpec) -> bool:
    """True when ``path`` holds a complete tiny model saved from exactly ``cfg``, with the tokenizer this
    version builds (older builds saved a character tokenizer that transformers loads without newlines)."""
    return (
        _stored_config(path) == _config_json(cfg)
        and (path / "config.json").is_file()
        and _saved_tokenizer_class(path) == TOKENIZER_CLASS
    )


def check_replaceable(path: Path) -> None:
    """Refuse to replace anything at ``path`` that this module did not create (or an empty directory)."""
    if not path.exists():
        return
    if path.is_dir() and (_stored_config(path) is not None or not any(path.iterdir())):
        return
    raise FileExistsError(
        f"{path} exists and is not a tiny model saved by ROLL (no {TINY_CONFIG_FILE}); refusing to "
        "overwrite it. Choose another directory for the tiny model or remove this one."
    )


def _swap_in(staging: Path, path: Path) -> None:
    """Move the finished ``staging`` directory to ``path``, replacing an older build there.

    A rename within one directory is atomic, so readers see either the old complete model or the new
    one, never a half-written directory. Renaming onto a non-empty directory fails on POSIX, so an
    existing build is first moved aside and deleted afterwards.
    """
    old: Path | None = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    try:
        os.replace(staging, path)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def save_tiny_model(cfg: TinyModelSpec, path: str | os.PathLike) -> Path:
    """Build the tokenizer and model for ``cfg`` and save both (safetensors) to ``path``; return ``path``.
    A vision-language model also gets its image processor (``preprocessor_config.json``) and
    ``processor_config.json``.

    Idempotent: when ``path`` already holds a model built from an identical config, nothing is rebuilt
    (re-running a quickstart is instant and keeps file times). A different config replaces the old build.
    Anything else already at ``path`` is never overwritten (FileExistsError).
    """
    path = Path(path)
    if _is_built_from(path, cfg):
        return path
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Stage beside the target so the final rename stays on one filesystem (and so is atomic).
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    from roll.models.tokenizer import build_char_tokenizer

    try:
        tokenizer = build_char_tokenizer(
            cfg.alphabet, model_max_length=cfg.max_position_embeddings, vision=cfg.vision is not None
        )
        model = build_tiny_model(cfg, tokenizer)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if cfg.vision is not None:
            build_tiny_image_processor(cfg.vision).save_pretrained(staging)
            processor = {"processor_class": PROCESSOR_CLASS}
            (staging / PROCESSOR_CONFIG_FILE).write_text(json.dumps(processor, indent=2), encoding="utf-8")
        (staging / TINY_CONFIG_FILE).write_text(json.dumps(_config_json(cfg), indent=2), encoding="utf-8")
        try:
            _swap_in(staging, path)
        except OSError:
            # Another process may have finished the same build first; its result is as good as ours.
            if not _is_built_from(path, cfg):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
