"""One multi-turn episode as tokens: the policy's sampled ids, the observations' ids between them, the
masks, and why it ended. Pure: no Ray, no model; whoever owns the episode asks ``next_request`` for the
ids to generate from, generates, and hands the turn to ``add_turn``, which steps the environment.

Layout of the finished episode (one training sample, trajectory-wise):

    prompt_ids:    system + first observation + generation prompt
    response_ids:  turn 1 (sampled) | observation 2 (template) | turn 2 (sampled) | ... | turn n
    loss_mask:     1 ... 1          | 0 ... 0                  | 1 ... 1          | ... | 1 ... 1
    logprobs:      the engine's     | 0                        | the engine's     | ...

The ids of a turn are the engine's, unchanged; its text is decoded only for the environment to read.

Budgets are separate and each ends the episode with its own ``StopReason``: ``max_tokens_per_turn``
(a turn that reaches it without a stop id is ``turn_truncated``; its text is never acted on),
``max_turns`` and ``max_context_tokens`` (prompt and response together; the next turn would not fit,
or the next observation would not).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from roll.data.chat_turns import ChatTurns
from roll.envs.base import TextEnv


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
    reward: float = 0.0
    action_is_valid: bool = True
    metrics: dict[str, float] = field(default_factory=dict)


class Episode:
    """One episode of ``env`` from ``seed``: call ``start``, then alternate ``next_request`` (None once
    the episode ended) and ``add_turn``."""

    def __init__(self, env: TextEnv, seed: int, chat: ChatTurns, budget: EpisodeBudget):
        self.env, self.seed, self.chat, self.budget = env, seed, chat, budget
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # per response token: the weights version (-1 on observations)
        self.turns: list[Turn] = []
        self.stop_reason: StopReason | None = None
        self.error: str | None = None

    # ----- the owner's calls ----------------------------------------------------------------------------

    def start(self) -> None:
        try:
            observation, _ = self.env.reset(self.seed)
        except Exception as error:  # noqa: BLE001 - an env failure costs the episode, never the run
            self._end(StopReason.ENV_ERROR, error)
            return
        self.prompt_ids = self.chat.first_prompt(observation)
        if len(self.prompt_ids) >= self.budget.max_context_tokens:
            self._end(StopReason.CONTEXT_LIMIT)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def next_request(self) -> tuple[list[int], int] | None:
        """The ids the next turn is generated from (the whole episode so far) and its token budget, or
        None when the episode has ended."""
        if self.done:
            return None
        context = self.prompt_ids + self.response_ids
        room = self.budget.max_context_tokens - len(context)
        return context, min(self.budget.max_tokens_per_turn, room)

    def add_turn(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], finish_reason: str
    ) -> None:
        """Append the policy's turn as sampled (``finish_reason``: the engine's "stop", "length" or
        "abort"), step the env with its text, and append the observation it returns, or end."""
        if self.done:
            raise RuntimeError(f"episode of seed {self.seed} already ended ({self.stop_reason.value})")
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError("a turn needs one logprob and one weights version per sampled token")
        start = len(self.response_ids)
        self._append(token_ids, trained=True, logprobs=logprobs, versions=versions)
        closed = bool(token_ids) and token_ids[-1] in self.chat.end_of_turn_ids
        text_ids = token_ids[:-1] if closed else token_ids
        turn = Turn(
            start, len(self.response_ids), self.chat.tokenizer.decode(text_ids, skip_special_tokens=True)
        )
        self.turns.append(turn)
        if finish_reason == "abort":
            self._end(StopReason.ABORTED)
            return
        if finish_reason != "stop":
            # Out of tokens mid-turn (max_tokens_per_turn, or the context): its text is not an action.
            full = len(self.prompt_ids) + len(self.response_ids) >= self.budget.max_context_tokens
            self._end(StopReason.CONTEXT_LIMIT if full else StopReason.TURN_TRUNCATED)
            return
        try:
            observation, reward, terminated, truncated, info = self.env.step(turn.text)
        except Exception as error:  # noqa: BLE001 - an env failure costs the episode, never the run
            self._end(StopReason.ENV_ERROR, error)
            return
        turn.reward, turn.action_is_valid = float(reward), bool(info.get("action_is_valid", True))
        turn.metrics = dict(info.get("metrics", {}))
        if terminated or truncated:
            self._end(StopReason.ENV_DONE)
            return
        if len(self.turns) >= self.budget.max_turns:
            self._end(StopReason.MAX_TURNS)
            return
        observed = self.chat.observation_ids(observation, turn_closed=closed)
        # The observation and at least one token of the next turn must fit.
        if len(self.prompt_ids) + len(self.response_ids) + len(observed) + 1 > self.budget.max_context_tokens:
            self._end(StopReason.CONTEXT_LIMIT)
            return
        self._append(observed, trained=False, logprobs=[0.0] * len(observed), versions=[-1] * len(observed))

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

    def summary(self) -> dict[str, Any]:
        valid = [turn.action_is_valid for turn in self.turns]
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

    def _end(self, reason: StopReason, error: BaseException | None = None) -> None:
        self.stop_reason = reason
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"
