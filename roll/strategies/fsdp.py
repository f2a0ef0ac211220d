"""Training strategy: torch FSDP2 (``fully_shard``) over the trainer's process group.

Each transformer block is its own FSDP unit (parameters all-gathered just before the block runs and freed
after), and the root module holds the rest (embeddings, final norm, head; tied embeddings stay in one
unit). One rank computing in its weights' dtype runs the plain module (sharding a single rank only adds
overhead); mixed precision is FSDP2's on every world size, one rank included.
"""

from __future__ import annotations

import sys

import torch


def is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor (an FSDP2 shard). None exists before ``torch.distributed.tensor`` is imported (sharding
    imports it), so the check leaves it unimported: importing it would lengthen every rollout and actor
    worker's start."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def shard_model(
    model: torch.nn.Module, compute_dtype: torch.dtype | None = None, scoring_only: bool = False
) -> torch.nn.Module:
    """Shard ``model`` in place across the default process group (every rank calls this).

    ``compute_dtype`` (e.g. bfloat16) is mixed precision: the weights stay in their dtype (the float32
    master copy the optimizer updates), each block's are cast to ``compute_dtype`` when gathered for its
    forward and backward, and gradients are reduced and kept in float32. None: compute in the weights'
    dtype. ``scoring_only``: a model that never runs backward (a reference) frees the root's gathered
    weights (embeddings, head) after each forward too; a trained one keeps them for the backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class in `_no_split_modules`; "
            "FSDP2 needs one to shard layer by layer"
        )
    policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=scoring_only)
    return model


def settle_gradient_dtypes(model: torch.nn.Module, device: torch.device) -> None:
    """Run a sharded model's first forward now (one token, no gradient; every rank calls this).

    FSDP2 fixes each group's gradient dtypes at the model's first forward, from the parameters that need a
    gradient at that moment. peft's ``disable_adapter`` (a LoRA reference pass) switches the adapter's off,
    so a first forward inside it would leave the adapter's gradients reduced in bf16 and then refused by
    its float32 weights."""
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()  # the root keeps its gathered weights after a forward, for a backward that is not coming


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective all-gather for a sharded (DTensor) one, the tensor itself otherwise.
    Every rank must call it for the same tensors in the same order."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor, the tensor itself otherwise (no communication)."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU, gathered on rank 0 (an empty dict on the other ranks) when
    sharded; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not any(is_sharded(p) for p in model.parameters()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over every rank's shard) and return it as a float."""
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    return float(full_tensor(norm))


def unwrapped_class_name(model: torch.nn.Module) -> str:
    """The model's own class name, under the subclass that ``fully_shard`` generates."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls.__name__
