"""Images in prompts: read from a dataset's image column, checked at load, and turned into what a
vision-language model reads beside the token ids.

A row's images are a path (relative to the dataset file, or absolute), raw bytes, a ``{"bytes", "path"}``
mapping (how Hugging Face ``datasets`` stores an ``Image`` feature), or a list of those. At load each image
is opened and decoded (an unreadable one is a ``DatasetError`` naming the file, the row and the image),
and its number of placeholder tokens is computed from its size: the prompt's ids are expanded once, then,
and never again (token-in-token-out). Pixel values are made when a prompt is drawn (``ImagePrompts.inputs``),
so a dataset of thousands of images does not hold them all in memory.

The expansion follows Qwen2-VL's processor (``Qwen2VLProcessor.replace_image_token``): each image token of
the rendered prompt becomes ``grid_t * grid_h * grid_w / merge_size**2`` copies of itself. ROLL does it
itself because transformers builds that processor only with torchvision installed (for its video part).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll.data.dataset import DatasetError

if TYPE_CHECKING:  # config code imports the field name: torch loads only where tensors are made
    import torch

__all__ = ["IMAGES", "IMAGE_TOKEN", "ImagePrompts", "ImageSource", "VisionInputs", "image_sources"]

# A row's images: the dataset field (image sources), and the batch field (each row's VisionInputs or None).
IMAGES = "images"
IMAGE_TOKEN = (
    "<|image_pad|>"  # Qwen2-VL's placeholder, which its processor expands (a tokenizer may rename it)
)


@dataclass(frozen=True)
class VisionInputs:
    """What a vision-language model reads besides the ids of one prompt (or of several, concatenated):
    the image processor's ``pixel_values`` [patches, features] and each image's ``image_grid_thw``
    [images, 3] (temporal, height and width, in patches), and the images themselves (``sources``: an
    engine that runs the image processor itself, vLLM, reads those). Travels with the sample (requests,
    batches)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    sources: tuple[ImageSource, ...] = ()

    @staticmethod
    def concat(items: Sequence[VisionInputs | None]) -> VisionInputs | None:
        """The inputs of several prompts in order (a batch's rows), or None when none has images."""
        present = [item for item in items if item is not None]
        if not present:
            return None
        import torch

        return VisionInputs(
            torch.cat([item.pixel_values for item in present]),
            torch.cat([item.image_grid_thw for item in present]),
            tuple(source for item in present for source in item.sources),
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VisionInputs:
        return VisionInputs(self.pixel_values.to(device, dtype), self.image_grid_thw.to(device), self.sources)


@dataclass(frozen=True)
class ImageSource:
    """One image of a row as the dataset gives it: a resolved path or the encoded bytes."""

    path: str | None = None
    data: bytes | None = None

    def open(self) -> Any:
        """The decoded image (RGB)."""
        from PIL import Image

        image = Image.open(self.path if self.path is not None else io.BytesIO(self.data))
        image.load()
        return image.convert("RGB")

    def describe(self) -> str:
        return self.path if self.path is not None else f"<{len(self.data or b'')} bytes>"


def image_sources(value: Any, base_dir: Path, where: str, column: str) -> tuple[ImageSource, ...]:
    """The images of one row's image column (see the module docstring), each opened and decoded once to
    check it. Raises a DatasetError naming ``where``, the ``column`` and the image."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise DatasetError(
            f"{where}: the image column ('{column}') is an empty list; give at least one image"
        )
    sources = []
    for position, item in enumerate(values, start=1):
        label = f"image {position} of '{column}'"
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            source = ImageSource(data=bytes(item))
        elif isinstance(item, str) and item.strip():
            path = Path(item) if os.path.isabs(item) else base_dir / item
            if not path.is_file():
                raise DatasetError(
                    f"{where}: {label} is '{item}', and {path} is not a file (relative paths are read from "
                    "the dataset file's directory)"
                )
            source = ImageSource(path=str(path))
        else:
            raise DatasetError(
                f"{where}: {label} is {type(item).__name__} {item!r:.40}; give a path, bytes or "
                "a {bytes, path} mapping"
            )
        try:
            source.open()
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a bad file
            raise DatasetError(
                f"{where}: {label} ({source.describe()}) cannot be read as an image: {e}"
            ) from None
        sources.append(source)
    return tuple(sources)


class ImagePrompts:
    """A vision-language model's image processor and image token: how many tokens an image takes, the
    expansion of a prompt's placeholders, and the pixel values of a prompt's images.

    Args:
        image_processor: a Hugging Face image processor (Qwen2-VL's: ``merge_size``, patches per image).
        tokenizer: the model's tokenizer; its ``image_token`` (default ``IMAGE_TOKEN``) is the placeholder.
    """

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.image_token: str = getattr(tokenizer, "image_token", None) or IMAGE_TOKEN
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no image token {self.image_token!r}")
        self.merge_size: int = int(getattr(image_processor, "merge_size", 1))

    def tokens_per_image(self, source: ImageSource) -> int:
        height, width = source.open().size[::-1]
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.merge_size**2

    def expand(self, token_ids: Sequence[int], counts: Sequence[int], where: str) -> list[int]:
        """``token_ids`` with the i-th image token repeated ``counts[i]`` times."""
        found = sum(1 for token in token_ids if token == self.image_token_id)
        if found != len(counts):
            raise DatasetError(
                f"{where}: the rendered prompt has {found} image placeholder(s) ({self.image_token}) for "
                f"{len(counts)} image(s); give one {{'type': 'image'}} content part per image"
            )
        expanded: list[int] = []
        remaining = iter(counts)
        for token in token_ids:
            expanded.extend([token] * next(remaining) if token == self.image_token_id else [token])
        return expanded

    def inputs(self, sources: Sequence[ImageSource]) -> VisionInputs:
        """The pixel values and grids of one prompt's images."""
        processed = self.image_processor(images=[source.open() for source in sources], return_tensors="pt")
        return VisionInputs(processed["pixel_values"], processed["image_grid_thw"].long(), tuple(sources))
