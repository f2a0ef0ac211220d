"""LoRA on the trained policy (peft): wrapping the model, the weights a sync sends, the adapter's files.

An adapted linear layer computes ``W_base x + scale * B (A x)`` with ``A`` [r, in], ``B`` [out, r] and
``scale = alpha / r``; only ``A`` and ``B`` train. Three payloads a weight sync can send (``PAYLOADS``):

- ``full``: every weight of a model trained in full (what a run without LoRA sends);
- ``adapter``: only ``<layer>.lora_A`` and ``<layer>.lora_B`` per adapted layer (``B`` already multiplied
  by ``scale``), for an engine that merges them into the base weights it keeps (``AdapterMerger``);
- ``merged``: every weight of the plain model, the adapted ones as ``W_base + scale * B A``, for an engine
  that can only load whole weights.

Names are the plain Hugging Face model's (``model.layers.0.self_attn.q_proj.weight``), never peft's
wrapped ones (``base_model.model....base_layer.weight``), so engines need not know about peft.
"""

from __future__ import annotations

import json
import math
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roll.strategies.fsdp import full_tensor, is_sharded

FULL, ADAPTER, MERGED = "full", "adapter", "merged"
PAYLOADS = (FULL, ADAPTER, MERGED)
ADAPTER_NAME = "default"  # peft's name for a model's only adapter
ADAPTER_CONFIG = "adapter_config.json"  # peft's file; its presence marks a directory as an adapter
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """What a trainer needs to add an adapter; fields named as in the ``actor.lora`` config section."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS


def block_linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the ``nn.Linear`` layers inside the model's transformer blocks (the
    classes its ``_no_split_modules`` names), in order of appearance: what ``target_modules`` may name.
    The LM head is left out: it sits outside the blocks and is often tied to the embedding."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    names: dict[str, None] = {}
    for block in (m for m in model.modules() if type(m).__name__ in block_classes):
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear) and name:
                names[name.rsplit(".", 1)[-1]] = None
    return list(names)


def target_problem(targets: Sequence[str], available: Sequence[str]) -> str | None:
    """Why ``targets`` cannot be adapted in a model whose blocks hold the linear layers ``available``
    (None when they can): an empty list, or names the blocks do not have, listed with the ones they do."""
    if not targets:
        return f"names no layer; choose among the model's linear layers: {', '.join(available)}"
    missing = [name for name in targets if name not in available]
    if missing:
        return (
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a linear layer of the model's "
            f"transformer blocks; its linear layers are: {', '.join(available)}"
        )
    return None


def apply_lora(model: torch.nn.Module, spec: LoraSpec, base_path: str) -> torch.nn.Module:
    """``model`` wrapped by peft with an adapter on ``spec.target_modules`` (B starts at 0, so the wrapped
    model computes what ``model`` did); every base weight is frozen. ``base_path`` (the directory the base
    was loaded from) is recorded in the adapter's config, so that an exported adapter names its base.

    Raises:
        ValueError: a target is not a linear layer of the model's blocks (the message lists those).
    """
    from peft import LoraConfig, get_peft_model

    problem = target_problem(list(spec.target_modules), block_linear_names(model))
    if problem is not None:
        raise ValueError(f"actor.lora.target_modules: {problem}")
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        base_model_name_or_path=str(Path(base_path).resolve()),
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        return get_peft_model(model, config)


PEFT_PREFIX = "base_model.model."  # what peft puts before the plain model's names


def stored_name(name: str) -> str:
    """A peft-wrapped model's weight under its plain model's name (the checkpoint's): the wrapper's
    prefix and the adapted layers' ``base_layer`` dropped."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def initial_adapter_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor | None:
    """The initial value of an adapter weight of a model built without data (sharded loading), as
    peft's default init draws it: ``B`` zero, so the adapted model starts as its base; ``A`` uniform in
    +-1/sqrt(in) (kaiming-uniform with a = sqrt(5)), from a generator seeded by ``seed`` and the weight's
    name, so every rank draws the same values whatever its shard. None for any other weight."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    if ".lora_A." not in name:
        return None
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


@contextmanager
def quiet_peft() -> Iterator[None]:
    """peft asks transformers about gradient checkpointing through a deprecated name, a FutureWarning in
    every worker's log that says nothing about the run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft-wrapped model (possibly under FSDP)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(plain model name, peft LoRA layer)`` of every adapted layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)]


def merge_weight(base: torch.Tensor, lora_a: torch.Tensor, scaled_b: torch.Tensor) -> torch.Tensor:
    """``base + scaled_b @ lora_a`` in float32, rounded once to ``base``'s dtype: rounding a bf16 sum of
    bf16 parts would lose more of a small update."""
    merged = base.float() + scaled_b.float() @ lora_a.float()
    return merged.to(base.dtype)


@dataclass(frozen=True)
class OutgoingWeight:
    """One tensor of a weight sync: its name, full shape and dtype (the plan), and how to make it.
    ``gather`` is a collective under FSDP: every trainer rank calls it, for the same weights in order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    gather: Callable[[], torch.Tensor]


def outgoing_weights(model: torch.nn.Module, payload: str) -> list[OutgoingWeight]:
    """The tensors ``payload`` (one of ``PAYLOADS``) sends from ``model``, in a fixed order.

    Raises:
        ValueError: an unknown payload, or ``adapter``/``merged`` from a model without an adapter.
    """
    if payload not in PAYLOADS:
        raise ValueError(f"unknown weight payload {payload!r}; expected one of {', '.join(PAYLOADS)}")
    if payload == FULL:
        return [_plain(name, tensor) for name, tensor in unique_state(model)]
    if not is_lora(model):
        raise ValueError(f"the {payload!r} weight payload needs a model with a LoRA adapter")
    layers = lora_layers(model)
    if payload == ADAPTER:
        out = []
        for name, layer in layers:
            a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
            scale = layer.scaling[ADAPTER_NAME]
            out.append(_plain(f"{name}.lora_A", a))
            out.append(OutgoingWeight(f"{name}.lora_B", tuple(b.shape), b.dtype, _scaled(b, scale)))
        return out
    adapted = {f"{name}.weight": layer for name, layer in layers}
    out = []
    for name, tensor in unique_state(model.get_base_model()):
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        layer = adapted.get(name)
        out.append(_plain(name, tensor) if layer is None else _merged(name, tensor, layer))
    return out


def unique_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every weight once: a tied head is the embedding under a second name, and the receiver ties it."""
    seen: set[int] = set()
    named = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            named.append((name, tensor))
    return named


def _plain(name: str, tensor: torch.Tensor) -> OutgoingWeight:
    return OutgoingWeight(name, tuple(tensor.shape), tensor.dtype, lambda: full_tensor(tensor).detach())


def _scaled(tensor: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
    return lambda: full_tensor(tensor).detach() * scale


def _merged(name: str, base: torch.Tensor, layer: Any) -> OutgoingWeight:
    a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
    scale = layer.scaling[ADAPTER_NAME]

    def gather() -> torch.Tensor:
        # One gather after another in a fixed order on every rank (each is a collective under FSDP).
        whole, lora_a, lora_b = full_tensor(base).detach(), full_tensor(a).detach(), full_tensor(b).detach()
        return merge_weight(whole, lora_a, lora_b * scale)

    return OutgoingWeight(name, tuple(base.shape), base.dtype, gather)


# ---------------------------------------------------------------- adapter files (peft format)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights, whole and on CPU, under peft's file names (``...q_proj.lora_A.weight``).
    Sharded weights are gathered to rank 0 (an empty dict elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if any(is_sharded(p) for p in model.parameters()):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(model, options=options)
    else:
        state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    suffix = f".{ADAPTER_NAME}."
    return {name.replace(suffix, "."): t.contiguous() for name, t in state.items() if ".lora_" in name}


def save_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write ``state`` (from ``adapter_state``) and the adapter's config in peft's format, which
    ``peft.PeftModel.from_pretrained(base, directory)`` loads."""
    from safetensors.torch import save_file

    save_file(state, str(directory / "adapter_model.safetensors"))
    model.peft_config[ADAPTER_NAME].save_pretrained(str(directory))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base_path(path: str | Path) -> str:
    """The base model directory an adapter saved by ``save_adapter`` was trained on."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
