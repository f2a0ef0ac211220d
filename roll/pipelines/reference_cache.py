"""Reference log-probabilities computed once and kept on disk, keyed by what they depend on.

A file holds one dataset's per-row reference values (``chosen_logps``, ``rejected_logps``, or a
teacher's outputs); its name is a digest of the dataset's fingerprint (its token ids) and the model's (the
bytes of its weights and config). Change either and the name changes, so stale values are never read: the
data is scored again. Files are written to a temporary name and renamed into place, so a run killed while
writing leaves no half file behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

# What a model's outputs depend on: its weights and its architecture. Tokenizer files are not hashed
# (the dataset fingerprint holds the token ids they produced).
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MODEL_CONFIG_FILES = ("config.json",)
_CHUNK = 1 << 24


def model_fingerprint(path: str | os.PathLike) -> str:
    """A digest of the model directory's config and weight files (names and bytes). Reads every weight
    file once per run, which is cheap against a pass of the model over the data (docs/dpo.md)."""
    root = Path(path)
    files = sorted(
        p
        for p in root.iterdir()
        if p.is_file() and (p.suffix in MODEL_FILE_SUFFIXES or p.name in MODEL_CONFIG_FILES)
    )
    if not files:
        raise FileNotFoundError(f"{root} holds no model weights to fingerprint")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def cache_file(
    cache_dir: str | os.PathLike, kind: str, dataset_fingerprint: str, model_fingerprint: str
) -> Path:
    """Where the values of ``kind`` (``reference``, ``teacher``, ...) for this dataset and model live."""
    key = hashlib.sha256(f"{kind}\0{dataset_fingerprint}\0{model_fingerprint}".encode()).hexdigest()[:32]
    return Path(cache_dir) / f"{kind}-{key}.pt"


def load_cached(path: Path, rows: int) -> dict[str, torch.Tensor] | None:
    """The tensors cached at ``path`` (each with ``rows`` rows), or None when there are none."""
    if not path.is_file():
        return None
    values = torch.load(path, weights_only=True)
    if any(len(tensor) != rows for tensor in values.values()):
        return None  # another dataset under a colliding name: score again rather than misread
    return values


def save_cached(path: Path, values: dict[str, torch.Tensor]) -> None:
    """Write ``values`` to ``path`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        torch.save(values, temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
