"""What a vision-language model's forward takes besides the ids: pixel values, image grids, and the
multimodal rotary positions (M-RoPE) of its prompt.

Qwen2-VL gives image tokens 3-D positions (temporal, height, width) and the text after an image
positions that jump past it; the model computes them from the ids, the image grids and
``mm_token_type_ids`` (``get_rope_index``). The engine, the rollout worker's scoring and the trainer all
call ``mrope_positions`` here on the same ids and grids, so the three see exactly the same positions. A
text token's three positions are equal, so after the prompt a row's positions are its text positions plus
one offset per row (``rope_deltas``): what the engine decodes with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from roll.data.images import VisionInputs

__all__ = [
    "placeholder_ids",
    "without_placeholders",
    "freeze_vision_tower",
    "is_vision_language",
    "mrope_positions",
    "vision_arguments",
    "vision_tower",
]


def _rope_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module of ``model`` (peft-wrapped or not) that computes M-RoPE positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    for candidate in (inner, base):
        if candidate is not None and hasattr(candidate, "get_rope_index"):
            return candidate
    return None


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether ``model`` reads images (a Qwen2-VL-style model with M-RoPE positions)."""
    return _rope_owner(model) is not None


def _image_token_id(model: torch.nn.Module) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return int(base.config.image_token_id)


def image_token_types(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` of ``input_ids``: 1 at image tokens, 0 at text."""
    return (input_ids == _image_token_id(model)).int()


def placeholder_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """The ids a vision-language model's prompts hold in place of pictures (image and video tokens).

    The policy never samples them: a response holding one would be read as a picture with no pixels by
    the trainer's forward (which replaces every image token of the ids by image features), while the
    engine read it as a token. So the engines give them no probability, and the trainer scores over the
    same vocabulary (``without_placeholders``): the two distributions stay the same. () for a text model.
    """
    if not is_vision_language(model):
        return ()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ids = (getattr(base.config, name, None) for name in ("image_token_id", "video_token_id"))
    return tuple(int(i) for i in ids if i is not None)


def without_placeholders(
    logits: torch.Tensor, ids: tuple[int, ...], temperature: float = 1.0
) -> torch.Tensor:
    """``logits`` [..., V] with the ``placeholder_ids`` at the lowest finite value (no probability; finite
    so that an entropy's ``p * logit`` stays 0, also after division by ``temperature``)."""
    if not ids:
        return logits
    floor = torch.finfo(logits.dtype).min * min(1.0, temperature)
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), floor)


def check_images_given(model: torch.nn.Module, input_ids: torch.Tensor, vision: VisionInputs | None) -> None:
    """Raise when ``input_ids`` hold image tokens and no images came with them: the model would read the
    placeholder's embedding instead of the picture, and nothing else would say so."""
    if vision is not None or not is_vision_language(model):
        return
    if bool((input_ids == _image_token_id(model)).any()):
        raise ValueError(
            "the prompt holds image tokens, but no images came with it: a batch lost its 'images' field "
            "on the way to this worker (every call that sends prompts must send the rows' images too)"
        )


def mrope_positions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    vision: VisionInputs | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions [3, B, T] of ``input_ids`` [B, T] (padding, where ``attention_mask`` is 0, at 0) and
    each row's offset [B] of text positions after its last image (0 for a row without images)."""
    owner = _rope_owner(model)
    if owner is None:
        raise TypeError(f"{type(model).__name__} has no multimodal positions (get_rope_index)")
    if vision is None:  # text only: the three positions are the text positions
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        text = (mask.long().cumsum(-1) - 1).clamp(min=0) * mask.long()
        return text.unsqueeze(0).expand(3, -1, -1), torch.zeros(input_ids.shape[0], dtype=torch.long)
    token_types = image_token_types(model, input_ids)
    positions, deltas = owner.get_rope_index(
        input_ids,
        mm_token_type_ids=token_types,
        image_grid_thw=vision.image_grid_thw.to(input_ids.device),
        attention_mask=attention_mask,
    )
    return positions, deltas.view(-1).long().cpu()


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model``'s vision tower (Qwen2-VL's ``visual``: patch embedding, blocks, merger), or None."""
    owner = _rope_owner(model)
    return getattr(owner, "visual", None) if owner is not None else None


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into ``model``'s vision tower; the number of weights frozen (0 for a text model)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    frozen = 0
    for parameter in tower.parameters():
        parameter.requires_grad_(False)
        frozen += parameter.numel()
    return frozen


def vision_arguments(model: torch.nn.Module, vision: VisionInputs, device: torch.device) -> dict:
    """The forward's image arguments: pixel values in the vision tower's dtype, and the grids."""
    visual = vision_tower(model)
    dtype = next(visual.parameters()).dtype if visual is not None else None
    return {
        "pixel_values": vision.pixel_values.to(device, dtype),
        "image_grid_thw": vision.image_grid_thw.to(device),
    }
