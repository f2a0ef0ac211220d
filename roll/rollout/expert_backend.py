"""A rollout backend whose "policy" is a scripted expert: the SFT warm start of agent programs plays the
user's agent program against it, so the demonstrations are recorded by the same sessions, in the same
token layout, as the runs RL later samples.

The expert (``roll.envs.agents``) reads each request's prompt as text, its chat template's rendering,
and writes the reply; the reply's ids, with the end of turn, are what it "sampled".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roll.rollout.backend import Events, RolloutBackend, ScoreJob
from roll.strategies.requests import GenerateRequest, GenerateResult

__all__ = ["ExpertBackend"]


class ExpertBackend(RolloutBackend):
    """``expert.act(prompt_text) -> reply``, encoded by ``tokenizer`` and closed with ``end_of_turn_id``."""

    num_workers = 1

    def __init__(self, expert: Any, tokenizer: Any, end_of_turn_id: int):
        self.expert, self.tokenizer, self.end_of_turn_id = expert, tokenizer, end_of_turn_id
        self._done: list[GenerateResult] = []

    def submit(self, worker: int, requests: Sequence[GenerateRequest]) -> None:
        for request in requests:
            prompt = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
            ids = list(self.tokenizer.encode(self.expert.act(prompt), add_special_tokens=False))
            ids = [*ids, self.end_of_turn_id][: request.params.max_new_tokens]
            reason = "stop" if ids[-1] == self.end_of_turn_id else "length"
            self._done.append(
                GenerateResult(request.request_id, ids, [0.0] * len(ids), reason, [0] * len(ids))
            )

    def abort(self, worker: int, request_ids: Sequence[str]) -> None:
        pass  # every reply is written at once: it comes back with its real end

    def score(self, jobs: Sequence[ScoreJob]) -> None:
        raise NotImplementedError("an agent program returns its own reward")

    def poll(self, timeout_s: float) -> Events:
        done, self._done = self._done, []
        return Events(generated=done)
