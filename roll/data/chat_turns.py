"""Token ids of a multi-turn conversation, built with the tokenizer's chat template one observation at a
time, so that the ids the policy sampled are never decoded and encoded again.

An observation after the first is tokenised as a delta. The template renders a fixed conversation that
ends with an assistant turn, and the same conversation with one more user turn (the observation) and
the generation prompt; the text between the two, with whatever the template writes after the token
that ends an assistant turn (ChatML's newline), is encoded alone. Its ids follow the policy's sampled
ids in the episode and are masked out of the loss.

Encoding the delta alone is what keeps token-in-token-out: encoding the whole conversation again
could merge the policy's last characters with the template's next ones into other ids (a BPE
tokenizer does), and the ids trained on would not be the ids sampled.

An observation with pictures (``roll.envs.base.ImageObservation``) is a user turn of image parts and its
text; its placeholders are expanded to each picture's token count as it is encoded (``vision``: the
vision-language model's ``ImagePrompts``), so its ids are final and its pictures travel beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll.data.images import ImagePrompts, ImageSource

# A conversation whose content no template rewrites: the delta of an observation does not depend on it.
_FIXED_USER, _FIXED_ASSISTANT = "x", "y"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot build an episode turn by turn (it rewrites earlier turns,
    or ends an assistant turn with something other than an end-of-turn token)."""


class ChatTurns:
    """The ids of an episode's first prompt and of each later observation, for ``tokenizer``.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        end_of_turn_ids: the ids that end the policy's turn (the engine's stop ids: every EOS id).
        system_prompt: the system message of every episode, if any.
        vision: a vision-language policy's image processing (``roll.data.images.ImagePrompts``), which
            observations with pictures need.

    Raises:
        ChatTemplateError: the template rewrites earlier turns when one is appended, or writes no
            end-of-turn token after an assistant turn.
    """

    def __init__(
        self,
        tokenizer: Any,
        end_of_turn_ids: Sequence[int],
        system_prompt: str | None = None,
        vision: ImagePrompts | None = None,
    ):
        self.tokenizer, self.vision = tokenizer, vision
        self.end_of_turn_ids = frozenset(end_of_turn_ids)
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        fixed = [*self.system, {"role": "user", "content": _FIXED_USER}]
        opened = self._render(fixed, generation_prompt=True) + _FIXED_ASSISTANT
        self._closed = self._render([*fixed, {"role": "assistant", "content": _FIXED_ASSISTANT}], False)
        if not self._closed.startswith(opened):
            raise ChatTemplateError(
                f"the chat template of {name} does not render an assistant turn as the generation prompt "
                "followed by the content: an episode cannot be built turn by turn with it"
            )
        # What the template writes after an assistant's content: its end-of-turn token, then a tail.
        after_content = self._closed[len(opened) :]
        end_texts = {tokenizer.decode([i]) for i in self.end_of_turn_ids}
        end = next((text for text in end_texts if text and after_content.startswith(text)), None)
        if end is None:
            raise ChatTemplateError(
                f"the chat template of {name} ends an assistant turn with {after_content!r}, which does not "
                f"start with an end-of-turn token ({sorted(end_texts)}): the policy's stop token would not "
                "close its turn"
            )
        # The id the template closes an assistant turn with (what an imitated turn ends with).
        self.end_turn_id = min(i for i in self.end_of_turn_ids if tokenizer.decode([i]) == end)
        self._after_end_of_turn = after_content[len(end) :]
        self._after_content = after_content

    def first_prompt(self, observation: Any) -> list[int]:
        """The ids of the episode's prompt: the system message, the first observation, the generation
        prompt."""
        content = self._content(observation)
        text = self._render([*self.system, {"role": "user", "content": content}], generation_prompt=True)
        return self._expanded(self._encode(text), observation)

    def images(self, observation: Any) -> tuple[ImageSource, ...]:
        """The pictures an observation shows, in the order of their placeholders (() for text)."""
        from roll.data.images import ImageSource

        return tuple(ImageSource(data=data) for data in getattr(observation, "images", ()))

    def observation_ids(self, observation: Any, turn_closed: bool = True) -> list[int]:
        """The ids that follow the policy's turn: the rest of its closing (ChatML's newline), the user
        turn holding ``observation`` and the next generation prompt. ``turn_closed``: the turn's last
        sampled id is an end-of-turn id; when False (a turn ended by another stop id) the end-of-turn
        token is part of the delta too.

        Raises:
            ChatTemplateError: the template renders earlier turns differently once one is appended.
        """
        ids = self.continuation_ids([{"role": "user", "content": self._content(observation)}], turn_closed)
        return self._expanded(ids, observation)

    def continuation_ids(self, messages: Sequence[dict[str, Any]], turn_closed: bool = True) -> list[int]:
        """The ids that follow the policy's turn when ``messages`` (user or tool turns, any the template
        renders) come next: the rest of its closing, the messages, the next generation prompt. See
        ``observation_ids``."""
        fixed = [
            *self.system,
            {"role": "user", "content": _FIXED_USER},
            {"role": "assistant", "content": _FIXED_ASSISTANT},
        ]
        extended = self._render([*fixed, *messages], generation_prompt=True)
        if not extended.startswith(self._closed):
            raise ChatTemplateError(
                "the chat template rewrites earlier turns when a turn is appended (some strip earlier "
                "reasoning): the ids of past turns would change, which breaks token-in-token-out"
            )
        head = self._after_end_of_turn if turn_closed else self._after_content
        return self._encode(head + extended[len(self._closed) :])

    def _content(self, observation: Any) -> Any:
        """A user turn's content: the text, or an image observation's image parts then its text."""
        if isinstance(observation, str):
            return observation
        if self.vision is None:
            raise ValueError(
                "the environment shows pictures, and the policy is a text-only model; train a "
                "vision-language model (model.path, or model.tiny.vision) or render the env as text"
            )
        text = [{"type": "text", "text": observation.text}] if observation.text else []
        return [{"type": "image"} for _ in observation.images] + text

    def _expanded(self, ids: list[int], observation: Any) -> list[int]:
        """``ids`` with each picture's placeholder repeated to its token count."""
        images = self.images(observation)
        if not images:
            return ids
        assert self.vision is not None
        counts = [self.vision.tokens_per_image(image) for image in images]
        return self.vision.expand(ids, counts, "an observation of the environment")

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
