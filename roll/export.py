"""``roll export``: a run's trained policy as a directory other tools load.

A LoRA run saves its adapter (peft format, naming its base model) as the final model and in every
checkpoint; ``export`` writes that adapter out as it is, or with ``merge`` the merged model
(``W_base + alpha / r * B A`` in every adapted layer, by peft's own ``merge_and_unload``), which
``transformers`` loads like any causal LM. A fully fine-tuned run's model is already whole: ``merge``
copies it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from roll import checkpoint
from roll.strategies.lora import adapter_base_path, is_adapter_dir

FINAL_MODEL = "model"  # a run's final model (or adapter), under its output_dir
TRAINED_ROLE = "actor"


class ExportError(ValueError):
    """Nothing to export at the path given, or its base model is missing; the message says which."""


def find_trained(path: str | Path) -> Path:
    """The policy to export from ``path``: a model or adapter directory itself; a checkpoint's
    ``actor/hf``; a run directory's final model, else its latest valid checkpoint's.

    Raises:
        ExportError: ``path`` holds none of these.
    """
    path = Path(path)
    if (path / "config.json").is_file() or is_adapter_dir(path):
        return path
    if (path / checkpoint.MANIFEST).is_file():
        problem = checkpoint.verify(path)
        if problem is not None:
            raise ExportError(f"checkpoint {path} cannot be used: {problem}")
        return path / TRAINED_ROLE / "hf"
    if (path / FINAL_MODEL).is_dir():
        return path / FINAL_MODEL
    latest = checkpoint.latest_valid(checkpoint.checkpoints_root(path))
    if latest is not None:
        return latest / TRAINED_ROLE / "hf"
    raise ExportError(
        f"{path} holds nothing to export: it is not a run directory (no {FINAL_MODEL}/ and no valid "
        "checkpoint), a checkpoint directory or a model/adapter directory"
    )


def default_destination(path: str | Path, merge: bool) -> Path:
    """``<run>/export/<model or step_N>-<merged|adapter>``; beside a bare model directory otherwise."""
    path = Path(path)
    suffix = "merged" if merge else "adapter"
    if (path / checkpoint.MANIFEST).is_file():  # <run>/checkpoints/step_N
        return path.parent.parent / "export" / f"{path.name}-{suffix}"
    if (path / FINAL_MODEL).is_dir() or checkpoint.checkpoints_root(path).is_dir():
        return path / "export" / f"{FINAL_MODEL}-{suffix}"
    return path.with_name(f"{path.name}-{suffix}")


def export(source: str | Path, destination: str | Path, merge: bool, base: str | None = None) -> str:
    """Write the policy of ``source`` (see ``find_trained``) to ``destination``, atomically; returns a
    line saying what was written. ``base`` overrides the base model directory an adapter names.

    Raises:
        ExportError: nothing to export, an adapter without ``merge`` asked of a full model, or a base
            model that is not there.
    """
    trained = find_trained(source)
    target = Path(destination)
    if not is_adapter_dir(trained):
        if not merge:
            raise ExportError(
                f"{trained} is a whole model (the run trained every weight), not a LoRA adapter; use it as "
                "it is, or pass --merge to copy it"
            )
        _write(target, lambda staging: shutil.copytree(trained, staging, dirs_exist_ok=True))
        return f"{trained} holds no adapter (full fine-tuning); copied the model to {target}"
    if not merge:
        _write(target, lambda staging: shutil.copytree(trained, staging, dirs_exist_ok=True))
        return f"LoRA adapter of {trained} written to {target} (peft format)"
    base_path = base or adapter_base_path(trained)
    if not (Path(base_path) / "config.json").is_file():
        raise ExportError(
            f"the adapter {trained} was trained on {base_path}, which holds no model now; pass --base with "
            "the base model's directory"
        )
    _write(target, lambda staging: _merge_into(trained, base_path, staging))
    return f"merged model (base {base_path} + adapter {trained}) written to {target}"


def _merge_into(adapter: Path, base_path: str, staging: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from roll.strategies.lora import quiet_peft

    hf_logging.disable_progress_bar()  # a bar per shard says nothing the result line does not
    base = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True, dtype="auto")
    with quiet_peft():
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(staging)
    # The run saved its tokenizer beside the adapter; an adapter from elsewhere may rely on the base's.
    source = adapter if _has_tokenizer(adapter) else base_path
    AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(staging)


def _has_tokenizer(path: Path) -> bool:
    from roll.models.loading import TOKENIZER_FILES

    return any((path / name).is_file() for name in TOKENIZER_FILES)


def _write(target: Path, fill: Callable[[Path], object]) -> None:
    """Fill a staging directory beside ``target``, then rename it into place (replacing ``target``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
