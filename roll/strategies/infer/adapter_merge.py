"""An engine's side of a LoRA weight sync: receive only the adapter, and merge it into the weights itself.

The trainer sends ``<layer>.lora_A`` [r, in] and ``<layer>.lora_B`` [out, r] (B already scaled by
alpha / r, ``roll.strategies.lora``). The merger keeps a copy of each adapted layer's base weight, taken
the first time an adapter for it arrives (the engine then still holds the weights it loaded from disk),
and writes ``W = W_base + B A`` into the live layer, so generation runs on plain dense weights at full
speed. The base copies live in host memory, not on the engine's device, which keeps the engine's own
memory as it was; the cost is host memory, the size of the adapted layers' weights (docs/lora.md gives it
for Qwen2.5-0.5B and 7B).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from roll.strategies.lora import merge_weight

HALVES = ("lora_A", "lora_B")


class AdapterMerger:
    """Collects the halves of a sync's adapter (``receive``, bucket by bucket), then merges every layer
    that got both (``apply``). Not thread-safe: the engine calls it with its model lock held."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}  # layer name -> its base weight, on CPU
        self._received: dict[str, dict[str, torch.Tensor]] = {}  # layer -> half -> tensor of this sync

    @property
    def pending(self) -> bool:
        return bool(self._received)

    def receive(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep copies of adapter tensors (the sender's buffers are reused after this returns).

        Raises:
            ValueError: a name that is not ``<layer>.lora_A`` or ``<layer>.lora_B``.
        """
        for name, tensor in named_tensors:
            layer, _, half = name.rpartition(".")
            if half not in HALVES or not layer:
                raise ValueError(f"{name!r} is not an adapter tensor (<layer>.lora_A or <layer>.lora_B)")
            self._received.setdefault(layer, {})[half] = tensor.detach().to("cpu", copy=True)

    def discard(self) -> None:
        """Forget what this sync received (a transfer that failed half way)."""
        self._received.clear()

    @torch.no_grad()
    def apply(self, model: torch.nn.Module) -> int:
        """Write ``W_base + B A`` into every layer that received both halves in this sync; returns how
        many layers changed. Nothing is written unless every received layer is complete and fits.

        Raises:
            ValueError: a layer the model does not have, a half missing, or shapes that do not fit
                (every problem listed).
        """
        received, self._received = self._received, {}
        problems, targets = [], {}
        for layer, halves in received.items():
            missing = [h for h in HALVES if h not in halves]
            weight = _weight_of(model, layer)
            if weight is None:
                problems.append(f"{layer}: the model has no linear layer of that name")
            elif missing:
                problems.append(f"{layer}: {' and '.join(missing)} did not arrive")
            else:
                a, b = halves["lora_A"], halves["lora_B"]
                if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(weight.shape):
                    problems.append(
                        f"{layer}: lora_B {tuple(b.shape)} x lora_A {tuple(a.shape)} does not make its "
                        f"weight's {tuple(weight.shape)}"
                    )
                else:
                    targets[layer] = (weight, a, b)
        if problems:
            raise ValueError("the adapter does not fit the inference model: " + "; ".join(problems))
        for layer, (weight, a, b) in targets.items():
            base = self._base.get(layer)
            if base is None:
                base = self._base[layer] = weight.detach().to("cpu", copy=True)
            device = weight.device
            weight.copy_(merge_weight(base.to(device), a.to(device), b.to(device)))
        return len(targets)


def _weight_of(model: torch.nn.Module, layer: str) -> torch.Tensor | None:
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        return None
    weight = getattr(module, "weight", None)
    return weight if isinstance(module, torch.nn.Linear) and weight is not None else None
