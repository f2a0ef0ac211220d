"""A rollout backend with controlled latencies on a virtual clock, for deterministic scheduler tests.

Each request's response and generation time come from a script; a reward takes ``reward_s``. ``poll``
jumps the clock to the next event instead of sleeping, so a test of a long-tail workload takes
microseconds and always sees the same order of events.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from roll.rollout.backend import Events, RolloutBackend, Scored, ScoreJob
from roll.strategies.requests import GenerateRequest, GenerateResult

# (request, sample index within its group) -> (response token ids, generation seconds)
Script = Callable[[GenerateRequest], tuple[list[int], float]]


@dataclass
class FakeTokenizer:
    """Token i decodes to the character chr(ord('a') + i); 0 is padding."""

    pad_token_id: int = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i != self.pad_token_id)


@dataclass
class FakeBackend(RolloutBackend):
    script: Script
    num_workers: int = 1
    reward_s: float = 0.0
    score_of: Callable[[ScoreJob], float] = lambda job: float(len(job.response_text))
    version: int = 0  # weights version stamped on every token
    now: float = 0.0
    submits: list[tuple[float, int, list[str]]] = field(default_factory=list)  # (time, worker, ids)
    aborts: list[tuple[float, list[str]]] = field(default_factory=list)
    scored_at: dict[str, float] = field(default_factory=dict)  # request id -> time its reward was sent
    generated_at: dict[str, float] = field(default_factory=dict)
    max_running: list[int] = field(default_factory=list)
    cut_at_max_tokens: bool = False  # a response longer than its max_new_tokens is cut there ("length")

    def __post_init__(self) -> None:
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._running: dict[str, int] = {}  # request id -> worker
        self._lock = threading.Lock()
        self.max_running = [0] * self.num_workers

    def clock(self) -> float:
        return self.now

    def submit(self, worker: int, requests: Sequence[GenerateRequest]) -> None:
        with self._lock:
            self.submits.append((self.now, worker, [r.request_id for r in requests]))
            for request in requests:
                tokens, seconds = self.script(request)
                finish = "stop"
                if self.cut_at_max_tokens and len(tokens) >= request.params.max_new_tokens:
                    tokens, finish = tokens[: request.params.max_new_tokens], "length"
                versions = [self.version] * len(tokens)
                result = GenerateResult(request.request_id, tokens, [-0.5] * len(tokens), finish, versions)
                self._push(self.now + seconds, "generated", result)
                self._running[request.request_id] = worker
            load = sum(1 for w in self._running.values() if w == worker)
            self.max_running[worker] = max(self.max_running[worker], load)

    def abort(self, worker: int, request_ids: Sequence[str]) -> None:
        with self._lock:
            self.aborts.append((self.now, list(request_ids)))
            dropped = set(request_ids) & set(self._running)
            self._events = [
                e for e in self._events if not (e[2] == "generated" and e[3].request_id in dropped)
            ]
            heapq.heapify(self._events)
            for request_id in dropped:
                self._push(self.now, "generated", GenerateResult(request_id, [], [], "abort"))

    def score(self, jobs: Sequence[ScoreJob]) -> None:
        with self._lock:
            for job in jobs:
                self.scored_at[job.request_id] = self.now
                self._push(self.now + self.reward_s, "scored", Scored(job.request_id, self.score_of(job)))

    def poll(self, timeout_s: float) -> Events:
        with self._lock:
            events = Events()
            if not self._events or self._events[0][0] > self.now + timeout_s:
                self.now += timeout_s
                return events
            self.now = max(self.now, self._events[0][0])
            while self._events and self._events[0][0] <= self.now:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "generated":
                    self._running.pop(payload.request_id, None)
                    self.generated_at[payload.request_id] = self.now
                    events.generated.append(payload)
                else:
                    events.scored.append(payload)
            return events

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, payload))
