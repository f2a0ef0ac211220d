"""Prompt datasets: rows of any supported format, their prompts rendered with the chat template and
tokenised once, at load.

Every problem a row can have (unparseable data, a missing column, a prompt that is empty, of the wrong
type or too long for ``data.max_prompt_length``, characters the tokenizer cannot represent) is a
``DatasetError`` naming the file and its line (JSONL) or row, raised before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from roll.data.columns import ANSWER, IMAGES, PROMPT, map_columns
from roll.data.dataset import DatasetError
from roll.data.domains import DEFAULT_DOMAIN
from roll.data.formats import read_rows
from roll.data.images import ImagePrompts, ImageSource, VisionInputs, image_sources
from roll.data.messages import Messages, checked_prompt, content_text, with_images


class PromptOptions(Protocol):
    """How prompts are read: the fields of the config's ``data`` section that loading needs. Declared here
    so that the data layer does not import the config (``roll.config.DataConfig`` has them)."""

    columns: dict[str, str]
    apply_chat_template: bool
    max_prompt_length: int


class PromptFiles(PromptOptions, Protocol):
    """Prompt options and the dataset files they apply to (``roll.config.DataConfig`` has them)."""

    train_path: str | None
    eval_path: str | None


@dataclass
class PromptSet:
    """Dataset rows with their rendered prompt text and token ids (tokenised once, at load), and the
    domain each row belongs to (``domains``; None: every row is in ``DEFAULT_DOMAIN``).

    A vision-language model's prompts also have their images (``images``: each row's, None for a row
    without); their ids hold the expanded image placeholders, and ``vision_inputs`` makes the pixel values
    of a row when it is drawn."""

    rows: list[dict]
    texts: list[str]
    token_ids: list[list[int]]
    domains: list[str] | None = None
    images: list[tuple[ImageSource, ...] | None] | None = None
    vision: ImagePrompts | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def vision_inputs(self, index: int) -> VisionInputs | None:
        """The pixel values and image grids of row ``index``'s images (None: a text prompt). Their token
        counts are checked against the ids expanded at load: the model must read what was tokenised."""
        sources = None if self.images is None else self.images[index]
        if sources is None:
            return None
        assert self.vision is not None
        inputs = self.vision.inputs(sources)
        tokens = int((inputs.image_grid_thw.prod(dim=1) // self.vision.merge_size**2).sum())
        # A demonstration row's response holds the pictures its environment showed after the prompt.
        ids = [*self.token_ids[index], *self.rows[index].get("response_ids", ())]
        placeholders = sum(1 for token in ids if token == self.vision.image_token_id)
        if tokens != placeholders:
            raise RuntimeError(
                f"prompt {index}'s images make {tokens} image tokens, but its ids hold {placeholders} "
                "placeholders: the image processor changed since the prompts were loaded"
            )
        return inputs

    def domain_of(self, index: int) -> str:
        return DEFAULT_DOMAIN if self.domains is None else self.domains[index]

    def domain_names(self) -> list[str]:
        """The domains of the rows, in order of first appearance."""
        return [DEFAULT_DOMAIN] if self.domains is None else list(dict.fromkeys(self.domains))

    def select(self, indices: Sequence[int]) -> PromptSet:
        return PromptSet(
            [self.rows[i] for i in indices],
            [self.texts[i] for i in indices],
            [self.token_ids[i] for i in indices],
            None if self.domains is None else [self.domains[i] for i in indices],
            None if self.images is None else [self.images[i] for i in indices],
            self.vision,
        )

    def by_domain(self) -> dict[str, PromptSet]:
        """The rows of each domain, in order."""
        if self.domains is None:
            return {DEFAULT_DOMAIN: self}
        return {
            name: self.select([i for i, d in enumerate(self.domains) if d == name])
            for name in self.domain_names()
        }

    @staticmethod
    def concat(named: dict[str, PromptSet]) -> PromptSet:
        """One set holding each domain's rows in turn, every row tagged with its domain's name."""
        sets = list(named.values())
        with_images = any(s.images is not None for s in sets)
        return PromptSet(
            [row for s in sets for row in s.rows],
            [text for s in sets for text in s.texts],
            [ids for s in sets for ids in s.token_ids],
            [name for name, s in named.items() for _ in range(len(s))],
            [image for s in sets for image in (s.images or [None] * len(s))] if with_images else None,
            next((s.vision for s in sets if s.vision is not None), None),
        )


def render_prompt(tokenizer: Any, prompt: str | Messages, apply_chat_template: bool) -> str:
    """The text the policy is prompted with: a text prompt as one user message, or a conversation, in
    the chat template with its generation prompt; without the template, the text itself."""
    if not apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def unknown_pieces(tokenizer: Any, texts: list[str]) -> list[list[str]]:
    """For each text, the characters that ``tokenizer`` cannot encode: those it turns into its unknown
    token and those it drops (a BPE whose vocabulary lacks some bytes, as the tiny models' character
    tokenizer, drops characters outside its alphabet). None for tokenizers that represent any text, as a
    byte-level BPE with every byte does. One batched call, then one per distinct character of a text that
    does not decode back to itself (offsets cannot say: a dropped byte shifts the offsets after it)."""
    if not texts:
        return []
    unk = tokenizer.unk_token_id
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    decoded = tokenizer.batch_decode(encoded, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    specials = sorted(
        set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True
    )
    encodable: dict[str, bool] = {}

    def can_encode(char: str) -> bool:
        if char not in encodable:
            ids = tokenizer(char, add_special_tokens=False, verbose=False)["input_ids"]
            encodable[char] = bool(ids) and unk not in ids
        return encodable[char]

    pieces = []
    for text, ids, back in zip(texts, encoded, decoded, strict=True):
        if back == text and (unk is None or unk not in ids):
            pieces.append([])
            continue
        for special in specials:
            text = text.replace(special, "")
        pieces.append([char for char in dict.fromkeys(text) if not can_encode(char)])
    return pieces


def check_representable(tokenizer: Any, texts: list[str], wheres: list[str], field: str) -> None:
    """Raise a DatasetError at the first ``where`` (file:line) whose ``field`` text the tokenizer would
    turn into unknown tokens: the model could neither read nor write it, and training on it silently
    teaches something else."""
    for where, unknown in zip(wheres, unknown_pieces(tokenizer, texts), strict=True):
        if unknown:
            pieces = ", ".join(map(repr, unknown))
            raise DatasetError(
                f"{where}: field '{field}' has characters the tokenizer does not know ({pieces}), which "
                "would be lost (or become the unknown token); remove them from the data, or with a tiny "
                "model add them to model.tiny.alphabet"
            )


def load_prompts(
    path: str,
    tokenizer: Any,
    data: PromptOptions,
    required_keys: Sequence[str] = (),
    target_key: str | None = None,
    columns: Mapping[str, str] | None = None,
    columns_key: str = "data.columns",
    vision: ImagePrompts | None = None,
) -> PromptSet:
    """Read a dataset file (any supported format) and tokenise every prompt. ``target_key`` names a
    field the model is trained to write (the SFT target), checked like the prompt for characters the
    tokenizer cannot represent. ``columns`` (field -> column; default ``data.columns``, set under
    ``columns_key``) renames the user's columns to the fields ROLL and the rewards read. ``vision`` (a
    vision-language model's image processing) reads the rows' images (``IMAGES``); without it a row with
    images is refused."""
    columns = data.columns if columns is None else columns
    located = read_rows(path)
    wheres = [where for where, _ in located]
    rows = map_columns(located, columns, (PROMPT, *required_keys), columns_key)
    column = columns.get(PROMPT, PROMPT)
    prompts = [
        checked_prompt(row[PROMPT], where, column, data.apply_chat_template)
        for where, row in zip(wheres, rows, strict=True)
    ]
    images = _row_images(path, wheres, rows, columns.get(IMAGES, IMAGES), vision, data.apply_chat_template)
    checked = prompts
    if images is not None:
        prompts = [p if found is None else with_images(p, len(found)) for p, found in zip(prompts, images)]
    # The model reads every message of a conversation: each is checked like a text prompt.
    contents = [
        (where, text)
        for where, prompt in zip(wheres, prompts, strict=True)
        for text in ([prompt] if isinstance(prompt, str) else [content_text(m["content"]) for m in prompt])
    ]
    check_representable(tokenizer, [text for _, text in contents], [where for where, _ in contents], column)
    if target_key is not None:
        check_representable(
            tokenizer, [str(row[target_key]) for row in rows], wheres, columns.get(target_key, target_key)
        )
    texts = [
        _rendered(tokenizer, prompt, data.apply_chat_template, where)
        for prompt, where in zip(prompts, wheres, strict=True)
    ]
    for row, prompt in zip(rows, checked, strict=True):
        row[PROMPT] = prompt  # without the nulls of an Arrow-backed conversation
        row.pop(IMAGES, None)  # kept once, as the sources: a row travels with every sample of a batch
    # verbose=False: a prompt beyond the model's length gets the error below, not transformers' warning.
    token_ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    if images is not None:
        assert vision is not None
        token_ids = [
            ids if found is None else vision.expand(ids, [vision.tokens_per_image(i) for i in found], where)
            for ids, found, where in zip(token_ids, images, wheres, strict=True)
        ]
    for where, ids in zip(wheres, token_ids, strict=True):
        if len(ids) > data.max_prompt_length:
            raise DatasetError(
                f"{where}: the prompt is {len(ids)} tokens, longer than "
                f"data.max_prompt_length={data.max_prompt_length}; raise it or shorten the prompt"
            )
    return PromptSet(rows, texts, token_ids, images=images, vision=vision)


def _row_images(
    path: str,
    wheres: list[str],
    rows: list[dict],
    column: str,
    vision: ImagePrompts | None,
    apply_chat_template: bool,
) -> list[tuple[ImageSource, ...] | None] | None:
    """Each row's images (None for a row without), or None when no row has any."""
    with_images = [(where, row) for where, row in zip(wheres, rows) if row.get(IMAGES) is not None]
    if not with_images:
        return None
    where = with_images[0][0]
    if vision is None:
        raise DatasetError(
            f"{where}: the row has images ('{column}'), but the model is text-only; train a vision-language "
            "model (model.path, or model.tiny.vision), or drop the column"
        )
    if not apply_chat_template:
        raise DatasetError(
            f"{where}: the row has images ('{column}'), which the chat template places in the prompt; set "
            "data.apply_chat_template=true"
        )
    base = Path(path).parent
    return [
        None if row.get(IMAGES) is None else image_sources(row[IMAGES], base, where, column)
        for where, row in zip(wheres, rows)
    ]


def _rendered(tokenizer: Any, prompt: str | Messages, apply_chat_template: bool, where: str) -> str:
    from jinja2 import TemplateError

    try:
        return render_prompt(tokenizer, prompt, apply_chat_template)
    except (TemplateError, ValueError) as e:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DatasetError(f"{where}: the chat template of {name} cannot render the prompt: {e}") from None


def load_datasets(
    data: PromptFiles,
    tokenizer: Any,
    train_fields: Sequence[str] = (),
    eval_fields: Sequence[str] = (),
    sft_targets: bool = False,
    vision: ImagePrompts | None = None,
) -> tuple[PromptSet, PromptSet | None]:
    """The training prompts and, when ``data.eval_path`` is set, the held-out ones; every row must have
    the listed fields (what the rewards and the SFT target read), checked now rather than mid-run. With
    ``sft_targets`` the training rows' ``answer`` is trained on and checked like a prompt."""
    target = ANSWER if sft_targets else None
    train = load_prompts(data.train_path, tokenizer, data, train_fields, target_key=target, vision=vision)
    held_out = (
        load_prompts(data.eval_path, tokenizer, data, eval_fields, vision=vision) if data.eval_path else None
    )
    return train, held_out
