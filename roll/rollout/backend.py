"""What the rollout scheduler asks of the workers, and its two implementations.

The scheduler (``roll.rollout.scheduler``) decides; a ``RolloutBackend`` does the I/O: send a group's
requests to a rollout worker, abort requests, send finished responses to the reward workers, and
``poll`` for whatever came back. Keeping the I/O behind this seam lets the scheduler run against a
fake backend with controlled latencies in tests (deterministic, no Ray).

- ``RayBackend``: rollout workers serving single requests (``RolloutRouter``), reward workers scoring
  responses as they arrive, all calls non-blocking and awaited together (``wait_any``); rewards cheaper
  than a Ray call are scored in the controller (``RewardDispatch``).
- ``BatchBackend``: a cluster that only generates whole batches (the actor with
  ``rollout.hybrid_engine``): the requests sent since the last poll become one batch generation.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from roll.data.batch import Batch
from roll.data.domains import DEFAULT_DOMAIN
from roll.data.padding import left_pad, right_pad
from roll.distributed.cluster import Cluster, ClusterFuture, wait_any
from roll.rewards.base import RewardError
from roll.rewards.scoring import DomainRewards, score_rows
from roll.rollout.router import RolloutRouter
from roll.strategies.requests import GenerateRequest, GenerateResult

__all__ = ["BatchBackend", "Events", "RayBackend", "RolloutBackend", "ScoreJob", "Scored"]


@dataclass
class ScoreJob:
    """One finished response to score: what the reward function reads."""

    request_id: str
    prompt_text: str
    response_text: str
    sample: dict
    response_ids: list[int]
    domain: str = DEFAULT_DOMAIN


@dataclass
class Scored:
    """A reward worker's verdict on one response."""

    request_id: str
    score: float
    token_rewards: list[float] | None = None
    info: dict[str, float] = field(default_factory=dict)  # the rewards' counters, e.g. timeouts


@dataclass
class Events:
    """What came back during one ``poll``."""

    generated: list[GenerateResult] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)


class RolloutBackend(abc.ABC):
    """Generation and reward I/O for the scheduler. Only the scheduler's pumping thread calls it."""

    num_workers: int

    @abc.abstractmethod
    def submit(self, worker: int, requests: Sequence[GenerateRequest]) -> None:
        """Send ``requests`` (one or more whole groups) to rollout worker ``worker``; returns at once."""

    @abc.abstractmethod
    def abort(self, worker: int, request_ids: Sequence[str]) -> None:
        """Abort requests on ``worker``; each still comes back (finish_reason "abort" or its real end)."""

    @abc.abstractmethod
    def score(self, jobs: Sequence[ScoreJob]) -> None:
        """Send finished responses to the reward workers; returns at once."""

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> Events:
        """Wait up to ``timeout_s`` for results; returns what arrived (possibly nothing)."""

    def release_prefixes(self, worker: int, cache_keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Tell rollout worker ``worker`` that the episodes ``cache_keys`` ended, so the KV it keeps for
        their next turn (``GenerateRequest.cache_key``) is freed now rather than evicted later; returns at
        once. A backend whose workers keep none (batch generation, fakes) does nothing."""

    def drain(self, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Wait up to ``timeout_s`` for the calls still open and drop what they bring, so that none of
        them takes results meant for a later scheduler on the same workers."""


def score_batch(jobs: Sequence[ScoreJob], pad_id: int) -> Batch:
    """The reward workers' input for ``jobs``: texts, dataset rows and the response token ids."""
    ids, mask = right_pad([job.response_ids or [pad_id] for job in jobs], pad_id)
    mask = mask * torch.tensor([bool(job.response_ids) for job in jobs], dtype=mask.dtype).unsqueeze(1)
    return Batch(
        tensors={"response_ids": ids, "response_mask": mask},
        non_tensors={
            "prompt_text": [job.prompt_text for job in jobs],
            "response_text": [job.response_text for job in jobs],
            "sample": [job.sample for job in jobs],
            "domain": [job.domain for job in jobs],
        },
    )


def scored_from(jobs: Sequence[ScoreJob], out: Batch) -> list[Scored]:
    token_rewards = out["token_rewards"] if "token_rewards" in out else [None] * len(jobs)
    infos = out["reward_info"] if "reward_info" in out else [{}] * len(jobs)
    return [
        Scored(job.request_id, float(score), rewards, info)
        for job, score, rewards, info in zip(jobs, out["scores"].tolist(), token_rewards, infos)
    ]


def domain_ranks(world_sizes: dict[str, int]) -> dict[str, list[int]]:
    """The reward cluster's ranks of each domain: ``world_sizes[d]`` consecutive ranks per domain, in
    order, so that a slow domain (code in a sandbox) never holds up another's scoring."""
    ranks, first = {}, 0
    for name, size in world_sizes.items():
        ranks[name] = list(range(first, first + size))
        first += size
    return ranks


class RewardDispatch:
    """Finished responses to their scorers. A domain in ``inline`` (``scored_in_controller``: rewards
    that cost less than a Ray call) is scored here, in the controller, at ``send``, and its scores wait
    in ``take_ready``. Every other domain's jobs go to the reward workers in non-blocking calls, spread
    over that domain's ranks (``ranks``; None: every rank scores every domain), those with the fewest
    responses outstanding first. ``calls`` are the calls in flight; ``take`` turns one that is ready
    into scores."""

    def __init__(
        self,
        reward: Cluster | None,
        pad_id: int,
        ranks: dict[str, list[int]] | None = None,
        inline: dict[str, DomainRewards] | None = None,
    ):
        self.reward, self.pad_id = reward, pad_id
        self.ranks = ranks
        self.inline = inline or {}
        self.calls: dict[ClusterFuture, tuple[int, list[ScoreJob]]] = {}  # future -> (rank, jobs)
        self._load = [0] * (reward.world_size if reward is not None else 0)
        self._ready: list[Scored] = []

    def ranks_of(self, domain: str) -> list[int]:
        if self.reward is None:
            raise KeyError(f"no reward workers for domain '{domain}' (the run scores only in the controller)")
        if self.ranks is None:
            return list(range(self.reward.world_size))
        if domain not in self.ranks:
            raise KeyError(f"no reward workers for domain '{domain}' (domains: {', '.join(self.ranks)})")
        return self.ranks[domain]

    def send(self, jobs: Sequence[ScoreJob], **kwargs: object) -> list[ClusterFuture]:
        """Start scoring ``jobs``; ``kwargs`` go to ``score_rows`` (e.g. ``evaluation=True``)."""
        futures = []
        for domain in dict.fromkeys(job.domain for job in jobs):
            same = [job for job in jobs if job.domain == domain]
            if domain in self.inline:
                self._ready += self._score_here(domain, same, kwargs)
                continue
            ranks = self.ranks_of(domain)
            shares = min(len(same), len(ranks))
            for part in range(shares):
                chunk = same[part::shares]
                rank = min(ranks, key=self._load.__getitem__)
                future = self.reward.call_rank(
                    rank, "compute_rewards", score_batch(chunk, self.pad_id), blocking=False, **kwargs
                )
                self.calls[future] = (rank, chunk)
                self._load[rank] += len(chunk)
                futures.append(future)
        return futures

    def _score_here(self, domain: str, jobs: list[ScoreJob], kwargs: dict) -> list[Scored]:
        try:
            return scored_from(jobs, score_rows(self.inline, score_batch(jobs, self.pad_id), **kwargs))
        except Exception as e:
            names = self.inline[domain].spec(bool(kwargs.get("evaluation"))).names()
            raise RewardError(
                f"the reward of domain '{domain}' ({', '.join(names)}) failed in the controller: "
                f"{type(e).__name__}: {e}"
            ) from e

    def take(self, future: ClusterFuture) -> list[Scored]:
        rank, jobs = self.calls.pop(future)
        self._load[rank] -= len(jobs)
        return scored_from(jobs, future.get())

    def take_ready(self) -> list[Scored]:
        """The scores made in the controller since the last call."""
        ready, self._ready = self._ready, []
        return ready

    def score(self, jobs: Sequence[ScoreJob], **kwargs: object) -> list[Scored]:
        """Score ``jobs`` and wait for them; results in the order of ``jobs``."""
        futures = self.send(jobs, **kwargs)
        by_id = {s.request_id: s for s in self.take_ready()}
        by_id.update({s.request_id: s for f in futures for s in self.take(f)})
        return [by_id[job.request_id] for job in jobs]


class RayBackend(RolloutBackend):
    """Rollout workers take single requests through ``router``; ``reward`` workers score responses in
    calls of their own. Every call is non-blocking and ``poll`` waits on all of them at once, so a reward
    is computed while the rest of the batch still generates."""

    def __init__(self, router: RolloutRouter, rewards: RewardDispatch):
        self.router = router
        self.num_workers = router.num_workers
        self.rewards = rewards

    def submit(self, worker: int, requests: Sequence[GenerateRequest]) -> None:
        self.router.send(worker, requests)

    def abort(self, worker: int, request_ids: Sequence[str]) -> None:
        self.router.abort(worker, request_ids)

    def release_prefixes(self, worker: int, cache_keys: Sequence[str]) -> None:
        self.router.release_prefixes(worker, cache_keys)

    def score(self, jobs: Sequence[ScoreJob]) -> None:
        self.rewards.send(jobs)

    def drain(self, timeout_s: float) -> None:
        self.router.drain(timeout_s)

    def poll(self, timeout_s: float) -> Events:
        futures = [*self.router.outstanding(), *self.rewards.calls]
        events = Events(scored=self.rewards.take_ready())
        # With scores in hand already, only take what else has arrived; do not wait.
        for future in wait_any(futures, 0.0 if events.scored else timeout_s):
            if future in self.rewards.calls:
                events.scored += self.rewards.take(future)
            else:
                events.generated += self.router.take(future)
        return events


class BatchBackend(RolloutBackend):
    """For a ``generator`` cluster with batch ``generate`` only (the actor as hybrid engine): ``poll``
    generates every request sent since the last poll in one call (one call per distinct sampling
    params), then scores pending responses and waits for them (one call per domain's rank). Results
    carry no weight versions: they come from the generator's current weights. Batch generation keeps
    no KV between calls, so ``release_prefixes`` has nothing to free."""

    num_workers = 1

    def __init__(self, generator: Cluster, rewards: RewardDispatch):
        self.generator, self.pad_id = generator, rewards.pad_id
        self.rewards = rewards
        self._requests: list[GenerateRequest] = []
        self._aborted: list[GenerateResult] = []
        self._jobs: list[ScoreJob] = []

    def submit(self, worker: int, requests: Sequence[GenerateRequest]) -> None:
        self._requests += requests

    def abort(self, worker: int, request_ids: Sequence[str]) -> None:
        # Nothing generates between polls: an abort always lands before generation, as an empty result.
        dropped = set(request_ids)
        self._aborted += [
            GenerateResult(r.request_id, [], [], "abort") for r in self._requests if r.request_id in dropped
        ]
        self._requests = [r for r in self._requests if r.request_id not in dropped]

    def score(self, jobs: Sequence[ScoreJob]) -> None:
        self._jobs += jobs

    def poll(self, timeout_s: float) -> Events:
        events = Events(generated=self._aborted)
        self._aborted = []
        requests, self._requests = self._requests, []
        for params in dict.fromkeys(r.params for r in requests):
            same = [r for r in requests if r.params == params]
            events.generated += self._generate(same)
        jobs, self._jobs = self._jobs, []
        if jobs:
            events.scored += self.rewards.score(jobs)
        return events

    def _generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        ids, mask = left_pad([r.prompt_ids for r in requests], self.pad_id)
        batch, _ = Batch(tensors={"prompt_ids": ids, "prompt_mask": mask}).pad_to_divisor(
            self.generator.world_size
        )
        out = self.generator.generate(batch, requests[0].params)
        results = []
        for row, request in enumerate(requests):
            kept = out["response_mask"][row].bool()
            results.append(
                GenerateResult(
                    request.request_id,
                    out["response_ids"][row][kept].tolist(),
                    out["rollout_logprobs"][row][kept].tolist(),
                    out["finish_reason"][row],
                )
            )
        return results
