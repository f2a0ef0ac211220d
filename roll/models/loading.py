"""Load Hugging Face causal LMs and tokenizers from local directories only.

ROLL never downloads at run time: `model.path` must name a directory that already holds the model.
`check_model_path` is cheap (no torch import) so config validation and the CLI can call it up front
and fail before any worker starts. A vision-language model (Qwen2-VL-style: its config has a
``vision_config``) loads through ``AutoModelForImageTextToText`` and has an image processor beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# A vision-language model's image processor, as transformers saves it.
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
# Any one of these is enough for AutoTokenizer to build a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Single-file or sharded (index) checkpoints, safetensors or legacy pickle.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)

_HOW_TO_FIX = (
    "Set model.path to a local directory holding a Hugging Face model (config.json, weights and "
    "tokenizer files, e.g. from `hf download ORG/NAME --local-dir DIR` on a machine with network), "
    "or set model.tiny to build a tiny model for tests and demos."
)


class ModelPathError(FileNotFoundError):
    """A model directory is missing or lacks files needed to load the model or tokenizer."""


def _missing_parts(path: Path, tokenizer: bool, weights: bool) -> str | None:
    """Describe what ``path`` lacks to be loaded, or None when nothing is missing."""
    if not path.exists():
        return "the directory does not exist"
    if not path.is_dir():
        return "it is not a directory"
    if not (path / "config.json").is_file():
        return "it has no config.json"
    if weights and not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        return "it has no weights (*.safetensors or pytorch_model*.bin)"
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"it has no tokenizer files (any of {', '.join(TOKENIZER_FILES)})"
    return None


def check_model_path(path: str | os.PathLike, *, tokenizer: bool = True, weights: bool = True) -> None:
    """Raise ModelPathError naming ``path``, what is missing and how to fix it, unless it looks loadable.

    ``tokenizer`` / ``weights``: also require tokenizer files / weight files (loaders that need only
    one of them switch the other off).
    """
    problem = _missing_parts(Path(path), tokenizer=tokenizer, weights=weights)
    if problem is not None:
        raise ModelPathError(f"Cannot load a model from {str(path)!r}: {problem}. {_HOW_TO_FIX}")


def is_vision_language(path: str | os.PathLike) -> bool:
    """Whether the model saved at ``path`` reads images: its ``config.json`` has a ``vision_config``
    (Qwen2-VL and its kin). False when there is no readable config; read without importing transformers."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("vision_config") is not None


def placeholder_token_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """The image and video placeholder ids of the vision-language model saved at ``path`` (from its
    ``config.json``; ``roll.strategies.vision.placeholder_ids`` reads a loaded model's), () for a text one."""
    if not is_vision_language(path):
        return ()
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    ids = (config.get(name) for name in ("image_token_id", "video_token_id"))
    return tuple(int(i) for i in ids if i is not None)


def load_image_processor(path: str | os.PathLike) -> Any:
    """The image processor of the vision-language model saved at ``path``, or None for a text-only model.

    Through ``AutoImageProcessor``: the torchvision-backed class where torchvision is installed, else the
    PIL one, asked for by name so that transformers does not warn about the fallback on every load.

    Raises:
        ModelPathError: a vision-language model without ``preprocessor_config.json``.
    """
    if not is_vision_language(path):
        return None
    if not (Path(path) / IMAGE_PROCESSOR_FILE).is_file():
        raise ModelPathError(
            f"Cannot load the image processor of the vision-language model at {str(path)!r}: it has no "
            f"{IMAGE_PROCESSOR_FILE}. Copy it from the model's original download (it comes with the weights)."
        )
    from transformers import AutoImageProcessor
    from transformers.utils import is_torchvision_available

    backend = "torchvision" if is_torchvision_available() else "pil"
    return AutoImageProcessor.from_pretrained(str(path), local_files_only=True, backend=backend)


# What a saved vision-language model keeps beside its weights and tokenizer so that AutoProcessor
# (and ROLL, from a warm start's directory) builds its processor again.
PROCESSOR_FILES = (IMAGE_PROCESSOR_FILE, "processor_config.json", "video_preprocessor_config.json")


def copy_processor_files(source: str | os.PathLike, target: str | os.PathLike) -> list[str]:
    """Copy the processor files of the model at ``source`` that exist into ``target``; their names."""
    import shutil

    copied = []
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(target) / name)
            copied.append(name)
    return copied


def _auto_model_class(path: str | os.PathLike) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language model, else ``AutoModelForCausalLM``."""
    import transformers

    if is_vision_language(path):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path``, left-padded and guaranteed to have a pad token.

    Tokenizers without a pad token (many base models) get EOS as pad: with left padding the pads sit
    before the prompt and are masked out by the attention mask, so their id never affects results, and
    reusing an existing token avoids growing the vocabulary past the model's embedding matrix.
    """
    from transformers import AutoTokenizer

    check_model_path(path, weights=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer at {str(path)!r} has neither a pad nor an eos token; add a pad token "
                "to its tokenizer_config.json."
            )
        tokenizer.pad_token = tokenizer.eos_token
    # Generation appends to the right end of each row, so prompts must be right-aligned.
    tokenizer.padding_side = "left"
    return tokenizer


def end_of_sequence_ids(
    tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module | None = None
) -> tuple[int, ...]:
    """Every token id that ends a response: the tokenizer's EOS, then each id of the model's generation
    config (``generation_config.json``; chat models list several there, Qwen2.5 both ``<|im_end|>`` and
    ``<|endoftext|>``, while the tokenizer names one). In that order, without repeats.

    Raises:
        ValueError: neither names one (generation could never end with "stop").
    """
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if declared is None:
        declared = []
    elif isinstance(declared, int):
        declared = [declared]
    ids = [tokenizer.eos_token_id, *declared]
    found = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    if not found:
        raise ValueError(
            "neither the tokenizer nor the model's generation config names an end-of-sequence token, so a "
            "response could never end with 'stop'; set eos_token in the tokenizer config"
        )
    return found


def turn_stop_ids(
    tokenizer: PreTrainedTokenizerBase, model_path: str, extra: Sequence[int] = ()
) -> tuple[int, ...]:
    """Every id that ends a sampled turn of the model saved at ``model_path``, as the engine stops on them:
    ``end_of_sequence_ids`` (its generation config read without loading the weights), then ``extra``
    (``rollout.stop_token_ids``)."""
    from transformers import GenerationConfig

    holder = None
    if (Path(model_path) / "generation_config.json").is_file():
        holder = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(model_path))
    return tuple(dict.fromkeys([*end_of_sequence_ids(tokenizer, holder), *(int(i) for i in extra)]))


# The package each FlashAttention kernel of transformers imports (sdpa, eager, flex_attention and
# sdpa_varlen are torch's).
ATTENTION_PACKAGES = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3"}
_ATTENTION_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def attention_problem(attn_implementation: str, dtypes: Sequence[str]) -> str | None:
    """Why ``attn_implementation`` cannot run here with weights in ``dtypes``, or None: a FlashAttention
    kernel needs its package installed and computes in bfloat16 or float16 only; ``sdpa_varlen`` needs a
    torch with varlen attention."""
    import importlib.util

    if attn_implementation == "sdpa_varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return "sdpa_varlen needs torch 2.10 or later (torch.nn.attention.varlen); use sdpa"
    module = _ATTENTION_MODULES.get(attn_implementation)
    if module is None:
        return None
    if importlib.util.find_spec(module) is None:
        return (
            f"{attn_implementation} needs the {ATTENTION_PACKAGES[attn_implementation]} package, which is "
            "not installed; install it (CUDA only) or use sdpa"
        )
    if "float32" in dtypes:
        return f"{attn_implementation} computes in bfloat16 or float16 only; set model.dtype: bfloat16"
    return None


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. float32, bfloat16, float16)")
    return torch_dtype


def _from_pretrained(
    auto_class: Any, path: str | os.PathLike, attn_implementation: str, **kwargs: Any
) -> Any:
    """``auto_class.from_pretrained`` with the attention kernel, naming the option when the model's class
    does not offer it."""
    _prepare_attention(path, attn_implementation)
    try:
        return auto_class.from_pretrained(
            str(path), local_files_only=True, attn_implementation=attn_implementation, **kwargs
        )
    except (ImportError, ValueError) as e:
        named = _attention_error(e, path, attn_implementation)
        if named is e:
            raise
        raise named from e


def build_causal_lm(
    path: str | os.PathLike, attn_implementation: str = "sdpa", dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """The causal LM of ``path``'s config, in ``dtype`` (default float32), its weights initialised but not
    read (under ``accelerate.init_empty_weights`` they stay on the meta device, for sharded loading). A
    vision-language config builds its image-text-to-text model (vision tower included)."""
    import torch
    from transformers import AutoConfig, GenerationConfig

    _prepare_attention(path, attn_implementation)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    try:
        model = _auto_model_class(path).from_config(
            config, attn_implementation=attn_implementation, dtype=dtype or torch.float32
        )
    except (ImportError, ValueError) as e:
        named = _attention_error(e, path, attn_implementation)
        if named is e:
            raise
        raise named from e
    try:  # its end-of-sequence ids, as from_pretrained reads them (end_of_sequence_ids)
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    except OSError:
        pass  # no generation_config.json: the one derived from config.json stays
    return model


def _prepare_attention(path: str | os.PathLike, attn_implementation: str) -> None:
    """Register ROLL's own attention kernel when asked for, refusing a model it cannot pack."""
    from roll.models import varlen_attention

    if attn_implementation == varlen_attention.NAME:
        from transformers import AutoConfig

        if varlen_attention.has_sliding_window(AutoConfig.from_pretrained(str(path), local_files_only=True)):
            raise ValueError(
                f"model.attn_implementation=sdpa_varlen cannot load {path}: its sliding-window attention "
                "layers cannot be packed this way. Use sdpa"
            )
        varlen_attention.register()


def _attention_error(e: Exception, path: str | os.PathLike, attn_implementation: str) -> Exception:
    """``e`` itself, or the error naming the option when the attention kernel is what failed."""
    if "attention" not in str(e).lower() and "attn" not in str(e).lower():
        return e
    reason = str(e).rstrip(".")
    return ValueError(
        f"model.attn_implementation={attn_implementation} cannot load {path}: {reason}. Use sdpa or eager"
    )


def load_causal_lm(
    path: str | os.PathLike,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """The causal LM saved at ``path`` with parameters in ``dtype`` (a torch dtype name), on ``device``,
    attending with transformers' ``attn_implementation``. A vision-language model loads whole, through
    ``AutoModelForImageTextToText`` (``is_vision_language``)."""
    check_model_path(path, tokenizer=False)
    torch_dtype = _torch_dtype(dtype)
    model = _from_pretrained(_auto_model_class(path), path, attn_implementation, dtype=torch_dtype)
    return model.to(device)


def load_value_model(
    path: str | os.PathLike,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A value model: the transformer saved at ``path`` with a scalar head on every position (``score``).

    From a causal LM checkpoint (the usual start: the policy's own weights) the head is new; it is
    zero-initialised so every value starts at 0 instead of at random. A saved value model loads as is.
    """
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    check_model_path(path, tokenizer=False)
    torch_dtype = _torch_dtype(dtype)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, num_labels=1)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized head" report is expected here, not a problem
    try:
        model, info = _from_pretrained(
            AutoModelForTokenClassification,
            path,
            attn_implementation,
            config=config,
            dtype=torch_dtype,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if any(key.startswith(VALUE_HEAD) for key in info["missing_keys"]):
        with torch.no_grad():
            for parameter in model.score.parameters():
                parameter.zero_()
    return _without_dropout(model).to(device)


def build_value_model(path: str | os.PathLike, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """The value model of ``path``'s config (``load_value_model``'s), in float32, its weights initialised
    but not read, for sharded loading (a head the checkpoint lacks is then zeroed there)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    _prepare_attention(path, attn_implementation)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, num_labels=1)
    try:
        model = AutoModelForTokenClassification.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32
        )
    except (ImportError, ValueError) as e:
        named = _attention_error(e, path, attn_implementation)
        if named is e:
            raise
        raise named from e
    return _without_dropout(model)


# A value model's head: new (zeroed) when it starts from a causal LM's checkpoint.
VALUE_HEAD = "score."


def _without_dropout(model: PreTrainedModel) -> PreTrainedModel:
    """The head's dropout (0.1 by default) would make values noisy and old/new values disagree."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model
