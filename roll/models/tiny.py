"""Tiny Qwen2 models with a character tokenizer, built from a config and saved in Hugging Face format.

Tests and the quickstart save the model to disk and load it back through `roll.models.loading`, so the
same loading path as for a real checkpoint is exercised without any network access.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch and transformers load in seconds: only building a model needs them
    from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

# Written last into a saved model directory: its presence marks the save complete, its content says
# which config built the model (so a later call with the same config can skip the rebuild).
TINY_CONFIG_FILE = "roll_tiny_config.json"
# Where a pipeline builds its tiny model, inside the run's output directory.
TINY_MODEL_DIR = "tiny_model"
# The class transformers' AutoTokenizer builds for a Qwen2 directory, which the tokenizer is built as.
TOKENIZER_CLASS = "Qwen2Tokenizer"


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


def build_tiny_model(cfg: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen2ForCausalLM:
    """A randomly initialised float32 Qwen2 causal LM sized by ``cfg``, with embeddings tied to the head.

    Initialisation is seeded by ``cfg.seed`` inside a forked RNG, so the same config always gives the
    same weights and the caller's global torch RNG state is left untouched.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
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
    # devices=[]: CPU RNG only; forking CUDA RNGs would initialise CUDA for no benefit.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.float32)
    # `generate` reads its stop and pad ids from here, not from the model config.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _config_json(cfg: TinyModelSpec) -> dict:
    """The config as plain JSON data, the form stored in ``TINY_CONFIG_FILE``."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


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
        tokenizer = build_char_tokenizer(cfg.alphabet, model_max_length=cfg.max_position_embeddings)
        model = build_tiny_model(cfg, tokenizer)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
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
