"""The rollout scheduler: every sample from request to reward, so that nothing waits that need not.

The pipeline asks ``scheduler.next_batch(step)`` for a training batch. Behind that call:

- Prompts are drawn from the dataset a group at a time (``num_return_sequences`` samples of one
  prompt) and each group goes whole to the rollout worker with the fewest requests in flight, up to
  ``max_running_requests`` per worker (``LoadBalancer.place_groups``).
- A response is sent to a reward worker as soon as it is generated, while the rest still generate.
- When a group is fully scored, the group filters decide (dynamic sampling): a kept group waits for
  its batch, a filtered one is dropped and another prompt is drawn in its place. Prompts in flight
  beyond what the batch still needs are bounded by ``max_additional_running_prompts``.
- The batch takes the first ``rollout_batch_size`` kept groups *in the order their prompts were
  drawn*: taking them in order of completion would favour short responses.
- Synchronous (``async_generation_ratio`` = 0): generation runs only inside ``next_batch``; once the
  batch is full, requests still running are aborted and their prompts go back to the front of the
  queue. With one sample per row and the same split over workers, a batch is the one that batch
  generation followed by batch scoring would give on the same seed.
- Asynchronous (ratio r > 0): a background thread keeps generating for the next r steps while the
  actor trains. Each token records the weights version that sampled it; after the weights move to
  version v (``set_weights_version``), a group whose oldest token (or, still generating, whose
  submission) predates v - r is aborted and its prompt drawn again, so no trained sample is more than
  r versions old. Requests in flight across a weight update continue on the new weights.

Every sample's transitions are timestamped (``roll.rollout.lifecycle``); ``next_batch`` returns the
per-stage waits, filtered and aborted fractions, prompts used and staleness with the batch.
``state_dict`` holds the dataset cursor and the prompts drawn but not yet trained on.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.algorithms.filters import GroupOutcome, rejecting_filter
from roll.data.batch import Batch
from roll.data.dataset import PromptIterator
from roll.data.prompts import PromptSet
from roll.rollout.backend import Events, RolloutBackend, Scored, ScoreJob
from roll.rollout.group_batch import assemble_batch
from roll.rollout.group_scheduler import GroupScheduler
from roll.rollout.lifecycle import Sample, SampleState, stage_seconds
from roll.rollout.load_balancer import LoadBalancer
from roll.rollout.prompt_group import PromptGroup
from roll.rollout.prompt_source import PromptSource
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

__all__ = ["RolloutScheduler", "SchedulerSpec"]

S = SampleState


@dataclass
class SchedulerSpec:
    """The scheduler's options; fields named as in the ``rollout`` config section."""

    rollout_batch_size: int
    num_return_sequences: int
    group_filters: list[str] = field(default_factory=list)
    max_additional_running_prompts: int | None = None
    max_prompts_per_step: int | None = None
    async_generation_ratio: int = 0
    max_running_requests: int | None = None

    @property
    def additional_prompts(self) -> int:
        """Prompts that may generate beyond what the batch still needs (only with group filters)."""
        if not self.group_filters:
            return 0
        extra = self.max_additional_running_prompts
        return self.rollout_batch_size if extra is None else extra

    @property
    def prompt_budget(self) -> int:
        """Most fresh prompts drawn between two batches."""
        return self.max_prompts_per_step or 8 * self.rollout_batch_size


class RolloutScheduler(GroupScheduler):
    """Owns each sample's lifecycle and hands the pipeline full training batches.

    Args:
        backend: the I/O to rollout and reward workers.
        prompts: the training prompts (token ids, texts, dataset rows).
        prompt_order: the dataset cursor (seeded, resumable).
        spec: batch size, group size, filters, async ratio, per-worker cap.
        params: sampling parameters of every request.
        tokenizer: decodes responses for the reward and gives the pad id.
        clock: the time source of the lifecycle timestamps (tests pass a virtual one).
        poll_s: how long one pump waits for results before it looks at the state again.
        params_for: sampling parameters per dataset row (e.g. a per-row token budget); unset: ``params``
            for every request.
        id_prefix: starts every request id. A scheduler that follows another on the same rollout
            workers (after a recovery) needs its own, so late results of the old one are told apart.
    """

    def __init__(
        self,
        backend: RolloutBackend,
        prompts: PromptSet,
        prompt_order: PromptIterator,
        spec: SchedulerSpec,
        params: SamplingParams,
        tokenizer: Any,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.02,
        params_for: Callable[[dict], SamplingParams] | None = None,
        id_prefix: str = "",
    ):
        super().__init__()
        self.backend, self.prompts = backend, prompts
        self.source = PromptSource(prompt_order, spec.prompt_budget)
        self.groups_per_batch, self.extra_groups = spec.rollout_batch_size, spec.additional_prompts
        self.id_prefix = id_prefix
        self.spec, self.params, self.tokenizer = spec, params, tokenizer
        self.clock, self.poll_s = clock, poll_s
        self.params_for = params_for or (lambda row: params)
        self.pad_id = tokenizer.pad_token_id
        self.balancer = LoadBalancer(backend.num_workers)
        # The live groups in draw order are the base's _drawn (a filtered group leaves it when resolved).
        self._samples: dict[str, Sample] = {}  # live samples by request id
        self._unsent: collections.deque[int] = collections.deque()  # group ids waiting for a worker
        self._filtered: collections.deque[PromptGroup] = collections.deque(maxlen=spec.rollout_batch_size)
        self._scoring = 0  # responses at the reward workers, dropped ones included

    def close(self) -> None:
        """Stop the background thread and abort every request in flight. A scheduler that takes over
        the same workers must first ``drain`` this one's backend."""
        self._stop_pumping()
        try:
            self._drop_all_live(wait=False)
        except Exception:  # noqa: BLE001 - workers may already be gone at shutdown
            pass

    # ----- pumping: draw, send, poll, react ------------------------------------------------------------

    def _pump(self, timeout_s: float | None = None) -> None:
        """One round: drop stale work, draw and send what is wanted, wait for results (up to ``poll_s``),
        react to them."""
        with self._lock:
            self._drop_stale()
            self._draw()
            self._send()
        events = self.backend.poll(self.poll_s if timeout_s is None else timeout_s)
        with self._lock:
            self._react(events)
            self._changed.notify_all()

    def _open(self, prompt_indices: list[int]) -> list[PromptGroup]:
        """A group per prompt, queued for a worker (the base draws them within the prompt budget)."""
        groups, now = [], self.clock()
        for prompt_index in prompt_indices:
            group_id = self._new_group_id()
            prefix = f"{self.id_prefix}g{group_id}"
            samples = [Sample(f"{prefix}-{i}", group_id, i) for i in range(self.spec.num_return_sequences)]
            for sample in samples:
                sample.times[S.QUEUED] = now
                self._samples[sample.request_id] = sample
            params = self.params_for(self.prompts.rows[prompt_index])
            groups.append(PromptGroup(group_id, prompt_index, samples, params))
            self._unsent.append(group_id)
        return groups

    def _send(self) -> None:
        """Send the queued groups that fit, each whole to one worker, one call per worker."""
        groups = [self._drawn[g] for g in self._unsent]
        workers = self.balancer.place_groups([len(g.samples) for g in groups], self.spec.max_running_requests)
        if not workers:
            return
        now = self.clock()
        per_worker: dict[int, list[GenerateRequest]] = {}
        for group, worker in zip(groups, workers):
            self._unsent.popleft()
            group.worker, group.submit_version = worker, self.weights_version
            prompt_ids = self.prompts.token_ids[group.prompt_index]
            group.vision = self.prompts.vision_inputs(group.prompt_index)  # the batch's rows read it too
            for sample in group.samples:
                self.balancer.assign_to(sample.request_id, worker)
                sample.move(S.GENERATING, now)
                request = GenerateRequest(sample.request_id, prompt_ids, group.params, vision=group.vision)
                per_worker.setdefault(worker, []).append(request)
            self._counts["samples_sent"] += len(group.samples)
        for worker, requests in per_worker.items():
            self.backend.submit(worker, requests)

    def _react(self, events: Events) -> None:
        now = self.clock()
        jobs = [job for result in events.generated if (job := self._on_generated(result, now)) is not None]
        if jobs:
            self._scoring += len(jobs)
            self.backend.score(jobs)
        for scored in events.scored:
            self._scoring -= 1
            self._on_scored(scored, now)

    def _on_generated(self, result: GenerateResult, now: float) -> ScoreJob | None:
        if not result.request_id.startswith(self.id_prefix):
            return None  # an earlier scheduler's request, aborted when it closed
        self.balancer.finish(result.request_id)
        sample = self._samples.get(result.request_id)
        if sample is None or sample.state is not S.GENERATING:
            return None  # dropped while it generated (stale, surplus, closing)
        if result.finish_reason == "abort":  # aborted by someone else (e.g. an engine shut down)
            self._drop_and_redraw([self._drawn[sample.group_id]])
            return None
        group = self._drawn[sample.group_id]
        sample.result = result
        sample.response_text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        sample.move(S.REWARDING, now)
        return ScoreJob(
            sample.request_id,
            self.prompts.texts[group.prompt_index],
            sample.response_text,
            self.prompts.rows[group.prompt_index],
            list(result.token_ids),
            self.prompts.domain_of(group.prompt_index),
        )

    def _on_scored(self, scored: Scored, now: float) -> None:
        sample = self._samples.get(scored.request_id)
        if sample is None or sample.state is not S.REWARDING:
            return
        sample.score, sample.token_rewards = scored.score, scored.token_rewards
        sample.reward_info = scored.info
        sample.move(S.DONE, now)
        group = self._drawn[sample.group_id]
        if all(s.state is S.DONE for s in group.samples):
            self._resolve(group, now)

    def _resolve(self, group: PromptGroup, now: float) -> None:
        """Every sample is scored: the group filters decide whether it is trained on."""
        outcome = GroupOutcome(
            scores=torch.tensor([s.score for s in group.samples], dtype=torch.float32),
            response_lengths=torch.tensor([len(s.result.token_ids) for s in group.samples]),
            finish_reasons=tuple(s.result.finish_reason for s in group.samples),
            sample=self.prompts.rows[group.prompt_index],
        )
        rejected = rejecting_filter(self.spec.group_filters, outcome)
        self._counts["groups_resolved"] += 1
        if rejected is None:
            group.kept = True
            return
        group.kept = False
        self._counts["groups_filtered"] += 1
        self._counts[f"filtered_by/{rejected}"] += 1
        for sample in group.samples:
            sample.move(S.FILTERED, now)
        self._forget(group)
        self._filtered.append(group)

    # ----- dropping work ----------------------------------------------------------------------------------

    def _drop(self, group: PromptGroup) -> None:
        """Abort a live group's unfinished requests and forget its samples."""
        now = self.clock()
        running = [s.request_id for s in group.samples if s.state is S.GENERATING]
        if running:
            self.backend.abort(group.worker, running)
        for sample in group.samples:
            if sample.state is not S.ABORTED:
                if sample.state in (S.GENERATING, S.QUEUED):
                    self._counts["samples_aborted"] += 1
                sample.move(S.ABORTED, now)
        # Aborted requests still come back and free their worker's slot; dropping the sample's
        # record tells _on_generated to ignore them.
        if group.worker is None:
            self._unsent.remove(group.group_id)
        self._forget_samples(group)

    def _forget(self, group: PromptGroup) -> None:
        del self._drawn[group.group_id]
        self._forget_samples(group)

    def _forget_samples(self, group: PromptGroup) -> None:
        for sample in group.samples:
            self._samples.pop(sample.request_id, None)

    def _drop_all_live(self, wait: bool = True) -> None:
        """Abort every live group (prompts go back to the front of the queue in draw order) and, with
        ``wait``, wait until the workers have answered for every request, so that nothing runs while
        the actor trains."""
        with self._lock:
            self._drop_and_redraw(list(self._drawn.values()))
        while wait and (sum(self.balancer.in_flight()) or self._scoring):
            self._pump()

    # ----- the batch ----------------------------------------------------------------------------------

    def _take_batch(self) -> list[PromptGroup] | None:
        """The first ``rollout_batch_size`` kept groups in draw order, once every group drawn before
        them is resolved; with the prompt budget spent and nothing left in flight, filtered groups fill
        the rest. None while not ready (or while stale groups wait for the pumping thread to drop them)."""
        taken = self._leading_ready()
        if taken is None:
            return None
        size = self.groups_per_batch
        if len(taken) < size:
            if any(not g.resolved for g in self._drawn.values()) or self.source.can_draw():
                return None
            fill = list(self._filtered)[-(size - len(taken)) :]
            if len(taken) + len(fill) < size:
                return None
            for group in fill:
                group.fallback = True
            self._counts["fallback_groups"] += len(fill)
            taken += fill
        for group in taken:
            if not group.fallback:
                self._forget(group)
        self._filtered.clear()
        return sorted(taken, key=lambda g: g.group_id)

    def _batch(self, groups: list[PromptGroup]) -> tuple[Batch, dict[str, float]]:
        if not self.spec.async_generation_ratio:
            self._drop_all_live()  # synchronous: nothing generates while the actor trains
        with self._lock:
            batch = assemble_batch(groups, self.prompts, self.pad_id, self.params.max_new_tokens)
            # Per row, how many versions behind the current weights its oldest token is: 0 marks a row
            # sampled entirely by the weights the actor trains, whose mismatch has no lag in it.
            batch["rollout_staleness"] = torch.tensor(
                [self._staleness(s) for g in groups for s in g.samples], dtype=torch.long
            )
            return batch, self._metrics(groups)

    def _staleness(self, sample: Any) -> int:
        return self.weights_version - min(sample.result.weight_versions, default=self.weights_version)

    def _metrics(self, groups: list[PromptGroup]) -> dict[str, float]:
        """What this batch cost: prompts used, filtered and aborted shares, stage waits, staleness."""
        now = self.clock()
        counts, self._counts = self._counts, collections.Counter()
        self.source.new_batch()
        samples = [s for g in groups for s in g.samples]
        stages: dict[str, list[float]] = collections.defaultdict(list)
        for sample in samples:
            for stage, seconds in stage_seconds(sample).items():
                stages[stage].append(seconds)
            stages["ready_wait"].append(now - sample.times[S.DONE])
        staleness = [self._staleness(s) for s in samples]
        resolved = counts["groups_resolved"]
        metrics = {
            "rollout/prompts_per_step": float(resolved),
            "rollout/filtered_frac": counts["groups_filtered"] / resolved if resolved else 0.0,
            "rollout/aborted_frac": counts["samples_aborted"] / max(counts["samples_sent"], 1),
            "rollout/stale_groups": float(counts["stale_groups"]),
            "rollout/fallback_groups": float(counts["fallback_groups"]),
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/staleness_max": float(max(staleness)),
            **{f"rollout/{stage}_s": sum(v) / len(v) for stage, v in stages.items()},
        }
        for key, value in counts.items():
            if key.startswith("filtered_by/"):
                metrics[f"rollout/{key}"] = float(value)
        return metrics
