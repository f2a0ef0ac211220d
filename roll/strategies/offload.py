"""Moving a worker's state to host memory and back between colocated stages, through host buffers that are
allocated once and reused by every later offload.

On CUDA the buffers are pinned (page-locked), so the copies run at the link's speed and need no staging
copy, and no later offload pays again for allocating host memory, which is what makes a fresh pageable
copy slow (docs/gpu.md). A CPU worker has nothing to move.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from roll.strategies.fsdp import is_sharded


def on_accelerator(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (its local shard, when sharded) lives off the host."""
    return tensor.device.type != "cpu"


class HostBuffers:
    """Host copies of a worker's device tensors: the model's parameters, buffers and gradients, and the
    tensors of extra state dicts (an optimizer's moments). Tensors are matched to buffers by the order they
    are visited in, which is the same at every offload; a buffer is reallocated only if its tensor's shape
    or dtype changed."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        # The state entries the last offload moved: reload returns exactly these.
        self._offloaded_entries: list[tuple[dict[str, Any], str]] = []

    def offload(self, module: torch.nn.Module, states: Iterable[dict[str, Any]] = ()) -> int:
        """Move ``module``'s tensors and those in ``states`` (in place) to host buffers; the bytes moved."""
        self._next, moved = 0, 0
        self._offloaded_entries = []

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal moved
            if not on_accelerator(tensor):
                return tensor  # already moved (a tied weight is visited twice) or a host tensor
            local = tensor.to_local() if is_sharded(tensor) else tensor
            moved += local.numel() * local.element_size()
            return _rewrap(tensor, self.copy(local))

        module._apply(to_host)  # what Module.to uses: parameters, buffers and gradients; FSDP2 re-registers
        for state in states:
            for key, value in state.items():
                if torch.is_tensor(value) and on_accelerator(value):
                    state[key] = to_host(value)
                    self._offloaded_entries.append((state, key))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the buffers are complete, and the device memory is free to release
            torch.cuda.empty_cache()
        return moved

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in the next host buffer (allocated on first use, pinned when the tensor is on
        CUDA). The copy from CUDA is asynchronous: ``offload`` waits for all of them at its end."""
        pin = tensor.is_cuda
        if self._next == len(self._buffers):
            self._buffers.append(torch.empty(0))
        buffer = self._buffers[self._next]
        if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.is_pinned() != pin:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[self._next] = buffer
        self._next += 1
        buffer.copy_(tensor, non_blocking=pin)
        return buffer

    def reload(self, module: torch.nn.Module, device: torch.device) -> int:
        """Move ``module``'s tensors, and the state entries the last ``offload`` moved, back to ``device``;
        the bytes moved. From pinned buffers the copies are asynchronous and ordered before any later
        kernel; the buffers stay for the next offload."""
        moved = 0

        def to_device(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal moved
            if _is_on(tensor, device):
                return tensor
            local = tensor.to_local() if is_sharded(tensor) else tensor
            moved += local.numel() * local.element_size()
            return tensor.to(device, non_blocking=True)

        module._apply(to_device)
        for state, key in self._offloaded_entries:
            state[key] = to_device(state[key])
        self._offloaded_entries = []
        if device.type == "cuda":
            torch.cuda.synchronize()
        return moved


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``like`` is: a DTensor with ``like``'s mesh, placements and shape when ``like`` is
    sharded. Built as DTensor's own operators build their results: ``DTensor.from_local`` would copy a
    host shard of a CUDA mesh straight back to the device."""
    if not is_sharded(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)
