"""Sharded loading: a trained model built with its weights on the meta device, sharded by FSDP2, and each
rank's shard read straight from the checkpoint's safetensors files, by slice.

No rank ever holds the whole model: a rank allocates its shard (1/N of the float32 weights on N ranks) and
reads those rows of each tensor from the files (memory-mapped), so loading a 7B model on 8 ranks costs
each 3.5 GB, not 28. Every rank reads the same files, so the shards agree without a broadcast. Buffers
that are not in the checkpoint (rotary tables) are built for real while the weights are on the meta
device, and kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from roll.strategies.fsdp import is_sharded, local_tensor, shard_model


@dataclass(frozen=True)
class LoadReport:
    """How a trainer rank loaded its model: ``sharded`` (this module) or ``whole`` (every rank loads the
    whole model, then shards it), and the bytes of weights it read from the checkpoint."""

    how: str
    bytes_read: int
    reason: str = ""  # why a rank loaded the whole model


def checkpoint_index(path: str | Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, or None where the directory has no safetensors
    files (a ``.bin`` checkpoint keeps the whole-model path)."""
    from safetensors import safe_open

    directory = Path(path)
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as tensors:
            index.update(dict.fromkeys(tensors.keys(), file))  # noqa: SIM118 - safe_open has no __iter__
    return index


def load_sharded(
    build: Callable[[], torch.nn.Module],
    path: str | Path,
    index: dict[str, Path],
    device: torch.device,
    compute_dtype: torch.dtype | None,
    prepare: Callable[[torch.nn.Module], None] = lambda model: None,
    scoring_only: bool = False,
    stored_as: Callable[[str], str] = lambda name: name,
    new_weight: Callable[[str, tuple[int, ...]], torch.Tensor | None] = lambda name, shape: None,
) -> tuple[torch.nn.Module, LoadReport]:
    """The model ``build()`` makes (called with its weights on the meta device), ``prepare``d (e.g.
    gradient checkpointing, before sharding), sharded across the default process group, then each rank's
    shard read from the files of ``index`` onto ``device``, in the dtype ``build`` gave the weights (the
    files' values cast to it). ``scoring_only``: see ``shard_model``. ``stored_as``: a weight's name in the
    files (a peft-wrapped model's are the plain model's). ``new_weight(name, shape)``: the whole initial
    value of a weight the files lack (a value model's head, a LoRA adapter), the same on every rank, or
    None. Every rank calls this.

    Raises:
        ValueError: a weight of the model is not in the checkpoint (nothing has been read).
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    # Outside the context: inside it every assignment makes a new meta parameter, so a tied head would
    # stay a weight of its own.
    model.tie_weights()
    stored_as = _in_the_files(model, index, stored_as)
    names = [name for name, _ in model.named_parameters()]  # tied weights once
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    fresh = {}
    for name in names:
        if stored_as(name) not in index:
            value = new_weight(name, shapes[name])
            if value is not None:
                fresh[name] = value
    missing = [name for name in names if stored_as(name) not in index and name not in fresh]
    if missing:
        raise ValueError(
            f"{path}: the checkpoint lacks {len(missing)} weight(s) of the model, e.g. {missing[:3]}"
        )
    prepare(model)
    model = shard_model(model, compute_dtype, scoring_only)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    read = 0
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for name, param in model.named_parameters():
            if name in fresh:
                local = local_tensor(param)
                start, stop = _rows(param, local) if param.dim() else (None, None)
                local.copy_(fresh[name][start:stop])
        for file, group in _by_file(model, index, stored_as, fresh).items():
            read += _read_shards(file, group)
    return model, LoadReport("sharded", read)


def _in_the_files(
    model: torch.nn.Module, index: dict[str, Path], stored_as: Callable[[str], str]
) -> Callable[[str], str]:
    """``stored_as`` followed by the renaming transformers applies when it loads the files: a
    vision-language model's files keep the names of the models it grew from (Qwen2-VL's ``visual.*`` and
    ``model.layers.*``), its modules are ``model.visual.*`` and ``model.language_model.layers.*``. A name
    no renaming touches is its own."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    plain = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper's model
    renamings = [t for t in get_model_conversion_mapping(plain) if isinstance(t, WeightRenaming)]
    if not renamings:
        return stored_as
    meta_state = plain.state_dict()
    loaded_as = {}
    for name in index:
        renamed, _ = rename_source_key(name, renamings, [], plain.base_model_prefix, meta_state)
        loaded_as[renamed] = name
    return lambda name: loaded_as.get(stored_as(name), stored_as(name))


def _by_file(
    model: torch.nn.Module, index: dict[str, Path], stored_as: Callable[[str], str], fresh: dict
) -> dict[Path, list[tuple[str, torch.Tensor]]]:
    """Each file's weights to read: (name in the file, the model's parameter)."""
    grouped: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        if name not in fresh:
            stored = stored_as(name)
            grouped.setdefault(index[stored], []).append((stored, param))
    return grouped


def _read_shards(file: Path, params: list[tuple[str, torch.Tensor]]) -> int:
    """Copy each parameter's rows of this rank from ``file``; returns the bytes read. The file is mapped
    once per tensor: the pages a mapping touched count as this process's memory until it is closed, so
    one mapping over the whole file would hold every shard's pages to the end."""
    from safetensors import safe_open

    read = 0
    for name, param in params:
        with safe_open(str(file), "pt") as tensors:
            stored = tensors.get_slice(name)
            local = local_tensor(param)
            shape = tuple(stored.get_shape())
            if shape != tuple(param.shape):
                raise ValueError(f"{file}: {name} has shape {shape}, the model's is {tuple(param.shape)}")
            if param.dim() == 0:  # a scalar is never split
                rows = tensors.get_tensor(name)
            else:
                start, stop = _rows(param, local)
                if stop == start:
                    continue
                rows = stored[start:stop]
            local.copy_(rows)
            read += rows.numel() * rows.element_size()
            del rows
    return read


def _rows(param: torch.Tensor, local: torch.Tensor) -> tuple[int, int]:
    """The rows of dim 0 this rank's shard holds: FSDP2 splits dim 0 as ``torch.chunk`` does (every rank
    but the last ones ``ceil(rows / ranks)``; the last may hold fewer, or none)."""
    if not is_sharded(param):
        return 0, param.shape[0]
    ranks, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = math.ceil(param.shape[0] / ranks)
    start = min(rank * chunk, param.shape[0])
    stop = min(start + chunk, param.shape[0])
    if local.shape[0] != stop - start:
        raise RuntimeError(
            f"{param.shape} on {ranks} ranks: rank {rank} holds {local.shape[0]} rows, not {stop - start}"
        )
    return start, stop


def whole_model_report(model: torch.nn.Module, reason: str) -> LoadReport:
    """The report of a rank that loaded the whole model (every weight read)."""
    read = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadReport("whole", read, reason)
