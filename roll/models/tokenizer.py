"""A character-level tokenizer built locally (no hub download) for tiny test and demo models.

Every character of the alphabet is one token, so arithmetic prompts such as ``"12 + 3"`` map to
predictable ids and a few-thousand-parameter model can learn them on a CPU in seconds.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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

# Only assistant turns end with EOS: that is the token the policy must learn to emit to stop.
# Whitespace control (`-`) keeps the template's own layout out of the rendered text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "<|system|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "<|assistant|>{{ message['content'] }}<|eos|>"
    "{%- else -%}"
    "{{ raise_exception('unknown chat role: ' ~ message['role'] ~ ' (expected system, user or assistant)') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

DEFAULT_MODEL_MAX_LENGTH = 2048


def _vocab(alphabet: str) -> dict[str, int]:
    """Special tokens first, then each distinct alphabet character in order of first appearance."""
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS.values(), *alphabet]:
        vocab.setdefault(token, len(vocab))
    return vocab


def _backend(alphabet: str) -> Tokenizer:
    """The raw `tokenizers` pipeline: split into single characters, look each up, fuse on decode."""
    backend = Tokenizer(models.WordLevel(_vocab(alphabet), unk_token=UNK_TOKEN))
    # `[\s\S]` (not `.`) so that newlines are characters too; each match becomes its own word.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates tokens with no separator; the default decoder would insert spaces.
    backend.decoder = decoders.Fuse()
    # Registered as special so they are matched as whole strings before character splitting.
    backend.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return backend


def build_char_tokenizer(
    alphabet: str, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> PreTrainedTokenizerFast:
    """Build a Hugging Face fast tokenizer where every character of ``alphabet`` is one token.

    Ids: ``<|pad|>``=0, ``<|eos|>``=1, ``<|unk|>``=2, ``<|system|>``=3, ``<|user|>``=4, ``<|assistant|>``=5,
    then the alphabet (duplicates ignored). Characters outside the alphabet encode to ``<|unk|>``.
    Encoding adds no BOS/EOS; padding is on the left, as generation needs.
    """
    if not alphabet:
        raise ValueError("alphabet must contain at least one character")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(alphabet),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        padding_side="left",
        model_max_length=model_max_length,
        # Clean-up would delete the spaces in "12 + 3" before punctuation; spaces are real tokens here.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
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


def build_bpe_tokenizer(corpus: list[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained locally on ``corpus``, with ChatML special tokens and template.

    Merge-prone on purpose: frequent pairs of the corpus (``"\\n_"``, ``"__"``, ``"P_"``) become single
    tokens, so text decoded and encoded again can come back as different ids. Tests of
    token-in-token-out code use it; a character tokenizer hides those bugs. ``<|im_end|>`` is EOS."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=DEFAULT_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
