"""Tokenizers built locally (no hub download) for tiny test and demo models.

Both are ``Qwen2Tokenizer``s: the tiny models are Qwen2, and for a Qwen2 model directory
``AutoTokenizer.from_pretrained`` always builds a ``Qwen2Tokenizer`` from the saved vocabulary and merges,
with Qwen2's own normalizer, split regex and byte-level pre-tokenizer, whatever ``tokenizer.json`` and
``tokenizer_config.json`` say. A tokenizer of another pipeline would be saved as one thing and loaded (by
us, plain transformers or vLLM) as another: a character tokenizer saved that way lost every newline.
Built as the class that loads, the tokenizer in memory and the one read back encode alike.

The character tokenizer makes every character of its alphabet one token, so arithmetic prompts such as
``"12 + 3"`` map to predictable ids and a few-thousand-parameter model can learn them on a CPU in seconds.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"

# Order fixes the ids: pad=0, eos=1, unk=2, then the role markers, then the alphabet.
SPECIAL_TOKENS: dict[str, str] = {
    "pad": PAD_TOKEN,
    "eos": EOS_TOKEN,
    "unk": UNK_TOKEN,
    "system": SYSTEM_TOKEN,
    "user": USER_TOKEN,
    "assistant": ASSISTANT_TOKEN,
}

# A vision-language tiny model's tokens, Qwen2-VL's names: an image renders as
# <|vision_start|><|image_pad|><|vision_end|>, and its <|image_pad|> is expanded to one copy per image
# token before the model reads it. <|video_pad|> is there so that a Qwen2-VL processor, which looks it up,
# finds a real id (no video is ever rendered).
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
# Appended after every other token (build_char_tokenizer(vision=True)): a text model's ids stay as they are.
VISION_TOKENS: tuple[str, ...] = (VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN)

# Only assistant turns end with EOS: that is the token the policy must learn to emit to stop.
# Whitespace control (`-`) keeps the template's own layout out of the rendered text. Tools as Qwen2.5 and
# Hermes write them, compactly: the tool names in a system turn, a call as <tool_call>{json}</tool_call>
# in the assistant's text, a result as a user turn's <tool_response>...</tool_response>. Their characters
# render only where the alphabet has them (examples/agent_calculator.yaml's does). A content may also be a
# list of parts, as vision-language datasets write it: {"type": "text", "text": ...} renders its text,
# {"type": "image"} the image's placeholder (Qwen2-VL's); a string renders as is.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string or content is mapping or content is not iterable -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else -%}"
    "{{ raise_exception('unknown content part type: ' ~ part['type'] ~ ' (expected text or image)') }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}<|system|><tools>"
    "{%- for tool in tools -%}{{ ' ' if not loop.first }}{{ tool['function']['name'] }}{%- endfor -%}"
    "</tools>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "<|system|>{{ render(message['content']) }}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user|>{{ render(message['content']) }}"
    "{%- elif message['role'] == 'tool' -%}"
    "<|user|><tool_response>{{ render(message['content']) }}</tool_response>"
    "{%- elif message['role'] == 'assistant' -%}"
    "<|assistant|>{{ render(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "<tool_call>{{ call['function'] | tojson(separators=(',', ':')) }}</tool_call>"
    "{%- endfor -%}<|eos|>"
    "{%- else -%}"
    "{{ raise_exception('unknown chat role: ' ~ message['role'] ~ "
    "' (expected system, user, assistant or tool)') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

DEFAULT_MODEL_MAX_LENGTH = 2048


def _byte_symbols(text: str) -> str:
    """``text`` as the byte-level pre-tokenizer writes it: one printable symbol per UTF-8 byte
    (``" "`` -> ``"Ġ"``, ``"\\n"`` -> ``"Ċ"``; other printable ASCII stays as is)."""
    symbol_of_byte = bytes_to_unicode()
    return "".join(symbol_of_byte[byte] for byte in text.encode("utf-8"))


def _char_vocab_and_merges(alphabet: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Special tokens first, then each distinct alphabet character (as its byte symbols) in order of first
    appearance; then, for characters of several UTF-8 bytes, their bytes and the merges that join them
    back into one token."""
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS.values(), *(_byte_symbols(char) for char in dict.fromkeys(alphabet))]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for char in dict.fromkeys(alphabet):
        symbols = _byte_symbols(char)
        for symbol in symbols:
            vocab.setdefault(symbol, len(vocab))
        for end in range(2, len(symbols) + 1):  # left to right: (b0, b1), (b0b1, b2), ...
            merges.append((symbols[: end - 1], symbols[end - 1]))
            vocab.setdefault(symbols[:end], len(vocab))
    return vocab, list(dict.fromkeys(merges))  # characters that share leading bytes share merges


def build_char_tokenizer(
    alphabet: str, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH, vision: bool = False
) -> Qwen2Tokenizer:
    """A Qwen2 tokenizer where every character of ``alphabet`` is one token.

    Ids: ``<|pad|>``=0, ``<|eos|>``=1, ``<|unk|>``=2, ``<|system|>``=3, ``<|user|>``=4, ``<|assistant|>``=5,
    then the alphabet (duplicates ignored; a character of several UTF-8 bytes also adds its bytes after
    the alphabet). Characters outside the alphabet are dropped, as a Qwen2 tokenizer drops bytes its
    vocabulary lacks. Encoding adds no BOS/EOS; padding is on the left, as generation needs.

    ``vision``: also ``VISION_TOKENS`` (a tiny vision-language model's), after all of those, so every other
    id is the text tokenizer's; special tokens, like the role markers, never split.
    """
    if not alphabet:
        raise ValueError("alphabet must contain at least one character")
    vocab, merges = _char_vocab_and_merges(alphabet)
    specials = [SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]
    if vision:
        for token in VISION_TOKENS:
            vocab.setdefault(token, len(vocab))
        specials += VISION_TOKENS
    return _qwen2_tokenizer(
        vocab,
        merges,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=specials,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def _qwen2_tokenizer(
    vocab: dict[str, int], merges: list[tuple[str, str]], chat_template: str, **kwargs: object
) -> Qwen2Tokenizer:
    """A ``Qwen2Tokenizer`` of ``vocab`` and ``merges``: left padding, and no clean-up on decode (it would
    delete the spaces in ``"12 + 3"`` before punctuation; spaces are real tokens here)."""
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, padding_side="left", clean_up_tokenization_spaces=False, **kwargs
    )
    tokenizer.chat_template = chat_template
    return tokenizer


# ChatML, as Qwen2 and many others write it: each turn ends with <|im_end|> and a newline, so a
# tokenizer built with it has text after the token that ends an assistant turn (the case a character
# template without a tail hides).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def build_bpe_tokenizer(corpus: list[str], vocab_size: int = 300) -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer trained locally on ``corpus``, with ChatML special tokens and
    template.

    Trained through Qwen2's own normalizer and pre-tokenizer, so it loads back from a saved directory
    unchanged. Merge-prone on purpose: frequent pairs of the corpus (``"RR"``, ``"__"``, ``"_\\n"``)
    become single tokens, so text decoded and encoded again can come back as different ids. Tests of
    token-in-token-out code use it; a character tokenizer hides those bugs. ``<|im_end|>`` is EOS."""
    reference = Qwen2Tokenizer()  # Qwen2's pipeline: train on exactly what it will split and normalise
    backend = Tokenizer(models.BPE())
    backend.normalizer = reference.backend_tokenizer.normalizer
    backend.pre_tokenizer = reference.backend_tokenizer.pre_tokenizer
    special = ["<|endoftext|>", IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return _qwen2_tokenizer(
        backend.get_vocab(),
        _trained_merges(backend),
        pad_token="<|endoftext|>",
        eos_token=IM_END,
        unk_token="<|endoftext|>",
        extra_special_tokens=[IM_START],
        model_max_length=DEFAULT_MODEL_MAX_LENGTH,
        chat_template=CHATML_TEMPLATE,
    )


def _trained_merges(backend: Tokenizer) -> list[tuple[str, str]]:
    """The merges of a trained BPE backend, in rank order (the `tokenizers` API exposes them only
    through the serialised model)."""
    import json

    model = json.loads(backend.to_str())["model"]
    return [
        tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]
    ]
