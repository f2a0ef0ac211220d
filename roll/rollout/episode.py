"""One multi-turn episode as tokens: the policy's sampled ids, the observations' ids between them, the
masks, and why it ended. Pure: no Ray, no model; whoever owns the episode asks ``next_request`` for the
ids to generate from, generates, and hands the turn to ``add_turn``, which steps the environment.

Layout of the finished episode (one training sample, trajectory-wise):

    prompt_ids:    system + first observation + generation prompt
    response_ids:  turn 1 (sampled) | observation 2 (template) | turn 2 (sampled) | ... | turn n
    loss_mask:     1 ... 1          | 0 ... 0                  | 1 ... 1          | ... | 1 ... 1
    logprobs:      the engine's     | 0                        | the engine's     | ...

The ids of a turn are the engine's, unchanged; its text is decoded only for the environment to read.

**Step-wise** (``history_turns`` set: one training sample per turn): each turn is generated from a
window instead of the whole episode: the first prompt rendered around the observation of ``history_turns``
turns back, then everything the episode holds since that turn (its sampled ids and observations,
unchanged). With ``history_turns=0`` a turn sees only the current observation (a Markov env needs no
more). The episode's record is the same in both layouts; ``turn_context(k)`` gives the ids turn ``k``
was generated from, and a step-wise sample is that context and the turn's sampled ids.

The environment is stepped here (``env`` given: tests, agents in one process) or by the owner
(``env=None``: the episode scheduler steps many episodes' environments per call on environment workers).
Then ``start(observation)`` takes the reset's observation, ``add_turn`` returns the action text to step
with, and ``observe`` takes the step's result.

An observation with pictures (``ImageObservation``, a vision-language policy) puts its expanded
placeholders among the ids, and the episode keeps its pictures where their ids start: ``turn_images(k)``
are the pictures of what turn ``k`` is generated from (its window, step-wise), ``images()`` those of the
whole episode, in the order of their placeholders, and ``vision_inputs`` makes their pixel values (once
per picture).

Budgets are separate and each ends the episode with its own ``StopReason``: ``max_tokens_per_turn``
(a turn that reaches it without a stop id is ``turn_truncated``; its text is never acted on),
``max_turns`` and ``max_context_tokens`` (what a turn is generated from plus the turn: the whole episode,
or step-wise its window; the next turn would not fit, or the next observation would not).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from roll.data.chat_turns import ChatTurns
from roll.data.images import ImageSource, VisionInputs
from roll.envs.base import Observation, TextEnv


class StopReason(str, enum.Enum):
    ENV_DONE = "env_done"  # the env terminated or truncated the episode
    MAX_TURNS = "max_turns"
    CONTEXT_LIMIT = "context_limit"
    TURN_TRUNCATED = "turn_truncated"  # a turn hit max_tokens_per_turn without a stop id
    ENV_ERROR = "env_error"
    ENV_TIMEOUT = "env_timeout"
    ABORTED = "aborted"


@dataclass(frozen=True)
class EpisodeBudget:
    max_turns: int
    max_tokens_per_turn: int
    max_context_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Turn:
    """What one turn did: where its sampled ids sit in ``response_ids``, the env's answer to it."""

    start: int
    end: int  # exclusive
    text: str
    observation: Observation = ""  # what the env showed before this turn (its state: GiGPO's anchor)
    reward: float = 0.0
    acted: bool = False  # the env stepped with it (a truncated or aborted turn is never acted on)
    action_is_valid: bool = True
    metrics: dict[str, float] = field(default_factory=dict)


class Episode:
    """One episode of ``env`` from ``seed``: call ``start``, then alternate ``next_request`` (None once
    the episode ended) and ``add_turn`` (then ``observe``, when the owner steps the env)."""

    def __init__(
        self,
        env: TextEnv | None,
        seed: int,
        chat: ChatTurns,
        budget: EpisodeBudget,
        history_turns: int | None = None,
    ):
        self.env, self.seed, self.chat, self.budget = env, seed, chat, budget
        self.history_turns = history_turns  # None: trajectory-wise (a turn sees the whole episode)
        if history_turns is not None and history_turns < 0:
            raise ValueError(f"history_turns must be >= 0 or None, got {history_turns}")
        self.observation: Observation = ""  # the env's latest (the last one, once the episode ended)
        self.prompt_ids: list[int] = []
        self.prompt_images: tuple[ImageSource, ...] = ()
        # Each observation's pictures after the prompt, by where its ids start in response_ids.
        self.observed_images: list[tuple[int, tuple[ImageSource, ...]]] = []
        self._pixels: dict[ImageSource, VisionInputs] = {}
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # per response token: the weights version (-1 on observations)
        self.turns: list[Turn] = []
        self.stop_reason: StopReason | None = None
        self.error: str | None = None
        self._closed = True  # the last turn ended with an end-of-turn id

    # ----- the owner's calls ----------------------------------------------------------------------------

    def start(self, observation: Observation | None = None) -> None:
        """Reset the env (or take the ``observation`` of the owner's reset) and build the prompt."""
        if observation is None:
            try:
                observation, _ = self.env.reset(self.seed)
            except Exception as error:  # noqa: BLE001 - an env failure ends only this episode
                self._end(StopReason.ENV_ERROR, error)
                return
        self.observation = observation
        self.prompt_ids = self.chat.first_prompt(observation)
        self.prompt_images = self.chat.images(observation)
        if len(self.prompt_ids) >= self.budget.max_context_tokens:
            self._end(StopReason.CONTEXT_LIMIT)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def next_request(self) -> tuple[list[int], int] | None:
        """The ids the next turn is generated from (the whole episode so far, or step-wise its window) and
        its token budget, or None when the episode has ended."""
        if self.done:
            return None
        context = self.turn_context(len(self.turns))
        room = self.budget.max_context_tokens - len(context)
        return context, min(self.budget.max_tokens_per_turn, room)

    def turn_context(self, k: int) -> list[int]:
        """The ids turn ``k`` is (or, for the next turn, will be) generated from: the whole episode before
        it, or step-wise the first prompt around the observation ``history_turns`` turns back followed by
        the episode's ids from that turn on (token for token as recorded)."""
        end = self.turns[k].start if k < len(self.turns) else len(self.response_ids)
        first = k - self.history_turns if self.history_turns is not None else 0
        if first <= 0:
            return self.prompt_ids + self.response_ids[:end]
        observation = self.turns[first].observation if first < len(self.turns) else self.observation
        start = self.turns[first].start if first < len(self.turns) else end
        return self.chat.first_prompt(observation) + self.response_ids[start:end]

    def turn_images(self, k: int) -> tuple[ImageSource, ...]:
        """The pictures among ``turn_context(k)``'s ids, in order."""
        end = self.turns[k].start if k < len(self.turns) else len(self.response_ids)
        first = k - self.history_turns if self.history_turns is not None else 0
        if first <= 0:
            head, start = self.prompt_images, 0
        else:
            observation = self.turns[first].observation if first < len(self.turns) else self.observation
            head = self.chat.images(observation)
            start = self.turns[first].start if first < len(self.turns) else end
        return head + self._images_between(start, end)

    def images(self) -> tuple[ImageSource, ...]:
        """The pictures among the whole episode's ids (prompt and response), in order."""
        return self.prompt_images + self._images_between(0, len(self.response_ids))

    def vision_inputs(self, images: tuple[ImageSource, ...]) -> VisionInputs | None:
        """The pixel values of ``images`` (None when there are none), each picture processed once."""
        if not images:
            return None
        assert self.chat.vision is not None
        for image in images:
            if image not in self._pixels:
                self._pixels[image] = self.chat.vision.inputs([image])
        return VisionInputs.concat([self._pixels[image] for image in images])

    def _images_between(self, start: int, end: int) -> tuple[ImageSource, ...]:
        return tuple(image for at, seen in self.observed_images if start <= at < end for image in seen)

    def add_turn(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], finish_reason: str
    ) -> str | None:
        """Append the policy's turn as sampled (``finish_reason``: the engine's "stop", "length" or
        "abort"). With an ``env``, step it with the turn's text and append the observation (or end);
        without, return the text the owner must step the env with (None: the episode ended)."""
        if self.done:
            raise RuntimeError(f"episode of seed {self.seed} already ended ({self.stop_reason.value})")
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError("a turn needs one logprob and one weights version per sampled token")
        start = len(self.response_ids)
        self._append(token_ids, trained=True, logprobs=logprobs, versions=versions)
        self._closed = bool(token_ids) and token_ids[-1] in self.chat.end_of_turn_ids
        text_ids = token_ids[:-1] if self._closed else token_ids
        text = self.chat.tokenizer.decode(text_ids, skip_special_tokens=True)
        turn = Turn(start, len(self.response_ids), text, observation=self.observation)
        self.turns.append(turn)
        if finish_reason == "abort":
            self._end(StopReason.ABORTED)
            return None
        if finish_reason != "stop":
            # Out of tokens mid-turn (max_tokens_per_turn, or the context): its text is not an action.
            full = len(self.prompt_ids) + len(self.response_ids) >= self.budget.max_context_tokens
            self._end(StopReason.CONTEXT_LIMIT if full else StopReason.TURN_TRUNCATED)
            return None
        if self.env is None:
            return turn.text
        try:
            result = self.env.step(turn.text)
        except Exception as error:  # noqa: BLE001 - an env failure ends only this episode
            self._end(StopReason.ENV_ERROR, error)
            return None
        self.observe(*result)
        return None

    def observe(
        self, observation: Observation, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]
    ) -> None:
        """The env's answer to the last turn: its reward and metrics, then the next observation (or the
        end of the episode)."""
        turn = self.turns[-1]
        turn.acted = True
        turn.reward, turn.action_is_valid = float(reward), bool(info.get("action_is_valid", True))
        turn.metrics = dict(info.get("metrics", {}))
        self.observation = observation
        if terminated or truncated:
            self._end(StopReason.ENV_DONE)
            return
        if len(self.turns) >= self.budget.max_turns:
            self._end(StopReason.MAX_TURNS)
            return
        observed = self.chat.observation_ids(observation, turn_closed=self._closed)
        pictures = self.chat.images(observation)
        if pictures:
            self.observed_images.append((len(self.response_ids), pictures))
        self._append(observed, trained=False, logprobs=[0.0] * len(observed), versions=[-1] * len(observed))
        # The next turn's context (with this observation) and at least one token of the turn must fit.
        if len(self.turn_context(len(self.turns))) + 1 > self.budget.max_context_tokens:
            self._drop_last(len(observed))
            if pictures:
                self.observed_images.pop()
            self._end(StopReason.CONTEXT_LIMIT)

    def end(self, reason: StopReason, error: BaseException | None = None) -> None:
        """End the episode from outside (an env timeout, an abort) if it has not ended."""
        if not self.done:
            self._end(reason, error)

    # ----- results --------------------------------------------------------------------------------------

    @property
    def episode_return(self) -> float:
        return sum(turn.reward for turn in self.turns)

    @property
    def success(self) -> bool:
        return any(turn.metrics.get("success", 0.0) > 0 for turn in self.turns)

    @property
    def failed(self) -> bool:
        """Ended by its environment failing (raised or hung twice) or by an abort: not a sample."""
        return self.stop_reason in (StopReason.ENV_ERROR, StopReason.ENV_TIMEOUT, StopReason.ABORTED)

    def summary(self) -> dict[str, Any]:
        valid = [turn.acted and turn.action_is_valid for turn in self.turns]
        return {
            "return": self.episode_return,
            "success": float(self.success),
            "turns": len(self.turns),
            "invalid_action_frac": valid.count(False) / len(valid) if valid else 0.0,
            "stop_reason": self.stop_reason.value if self.stop_reason else None,
        }

    # ----- internals ------------------------------------------------------------------------------------

    def _append(self, ids: list[int], trained: bool, logprobs: list[float], versions: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def _drop_last(self, n: int) -> None:
        for ids in (self.response_ids, self.loss_mask, self.logprobs, self.versions):
            del ids[len(ids) - n :]

    def _end(self, reason: StopReason, error: BaseException | None = None) -> None:
        self.stop_reason = reason
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"


def demonstration(
    env: TextEnv,
    agent: Any,
    seed: int,
    chat: ChatTurns,
    budget: EpisodeBudget,
    history_turns: int | None = None,
) -> Episode:
    """An agent's episode in exactly the layout RL samples (the SFT warm start imitates it): each action
    is the agent's text encoded alone and closed by the first end-of-turn id, as a policy would sample
    it; observations come from the chat template as in RL. A turn that does not fit ends the episode."""
    end_of_turn = chat.end_turn_id
    observation, _ = env.reset(seed)
    episode = Episode(None, seed, chat, budget, history_turns)
    episode.start(observation)
    while (request := episode.next_request()) is not None:
        ids = [*chat.tokenizer.encode(agent.act(observation), add_special_tokens=False), end_of_turn]
        if len(ids) > request[1]:
            episode.end(StopReason.TURN_TRUNCATED)
            break
        action = episode.add_turn(ids, [0.0] * len(ids), [0] * len(ids), "stop")
        if action is None:
            break
        observation, reward, terminated, truncated, info = env.step(action)
        episode.observe(observation, reward, terminated, truncated, info)
    return episode
