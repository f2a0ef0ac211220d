"""The agent scheduler: groups of agent-program runs (``roll.rollout.agent_runs``) instead of env episodes.

Each training task (a seed of ``TaskList``) gets a group of ``group_size`` runs (plus ``redundancy``), each
with a session of the endpoint (``roll.serving``; the record is ``roll.rollout.sessions``). The endpoint's
engine is this scheduler (``submit``, ``await_result``, ``abort``): a run's calls become requests to its
group's rollout worker, keyed by its session (the engine keeps the KV between its calls), sent and polled by
the pumping thread like every other request. What a run may set is bounded by the run's sampling: the
temperature and top_p are always the run's (``rollout.temperature``; greedy in greedy evaluation), so the
logprobs the trainer recomputes are those of the distribution that sampled; a call may ask for fewer tokens,
and more stops.

- **Groups** and **batches** work as for episodes (``roll.rollout.group_scheduler``): a group is its
  first ``group_size`` runs in start order that did not fail, complete once they all ended; a batch
  takes the first groups in draw order. Asynchronous training and the staleness bound apply as they do
  there, by the weights versions of a run's sampled tokens.
- **Budgets are outcomes.** A run has ``max_calls`` calls to the policy (``env.max_turns``) and
  ``max_context_tokens`` for a call's prompt and reply (``env.max_context_tokens``). The call that would
  pass either is answered at once as an API at its length limit answers: no text, ``finish_reason``
  ``length``. The run ends with that stop reason (``max_turns``, ``context_limit``) once its agent returns,
  or at once when it calls again; an agent that fails after its budget ran out scores 0 (it did not finish
  its task). It is trained, masked or zeroed as ``stop_policy`` (``env.stop_reasons``) says, as an
  episode is: the looping or verbose runs are what GRPO has to learn to avoid, not infrastructure failures.
- **Failures.** A run whose agent raised, ran past ``timeout_s``, never called the policy, or ended with
  no reward failed: its place in the group goes to the next run, and a group that can no longer
  complete is dropped and the next task drawn in its place (``agent/*_frac``, ``rollout/dropped_groups``);
  more than ``max_dropped_groups`` in one step stop the run, naming the agent's last error. A failed
  run is never trained on, and never scored 0.
- **Samples.** Trajectory-wise, one row per run: the branch of its session (``roll.rollout.sessions``)
  with the most sampled tokens. Its leading tokens up to the first sampled one are the prompt; the rest
  is the response, the sampled tokens trained and every other (tool results, the next user turn, a
  fork's unproven tokens) masked. A run's other branches (a sub-agent's context, an edited history) are
  counted (``agent/untrained_branches``) and not trained yet.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.data.batch import Batch
from roll.data.padding import left_pad, right_pad
from roll.data.prompts import PromptSet
from roll.rollout.agent_runs import AgentOutcome, AgentRunner, TaskList
from roll.rollout.backend import RolloutBackend
from roll.rollout.group_scheduler import GroupScheduler, Source
from roll.rollout.sessions import Branch, Session, SessionStore
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

__all__ = [
    "AgentGroup",
    "AgentRun",
    "AgentScheduler",
    "AgentSpec",
    "SchedulerEngine",
    "demonstrations",
    "run_batch",
    "run_metrics",
]

FAILURES = ("agent_error", "agent_timeout", "no_calls", "no_reward")
BUDGETS = ("max_turns", "context_limit")  # the stop reasons of a run that ran out of a budget
DONE = "agent_done"  # the stop reason of a run whose agent ended it


@dataclass(frozen=True)
class AgentSpec:
    """``groups_per_step`` tasks per batch, ``group_size`` runs each (+ ``redundancy``), each within
    ``timeout_s``, ``max_calls`` calls to the policy and ``max_context_tokens`` a call (None: unbounded
    here); ``stop_policy``: stop reason -> train, mask or zero (``env.stop_reasons``);
    ``async_generation_ratio`` as for episodes."""

    groups_per_step: int
    group_size: int
    timeout_s: float
    max_calls: int = 1 << 30
    max_context_tokens: int | None = None
    redundancy: int = 0
    async_generation_ratio: int = 0
    stop_policy: Mapping[str, str] = field(default_factory=dict)

    @property
    def max_dropped_groups(self) -> int:
        """Groups dropped in one step before the step fails (as ``EpisodeSpec``'s)."""
        return 4 * self.groups_per_step + 8


@dataclass(eq=False)
class AgentRun:
    """One run of the agent: its session, and once it ended, its ``outcome``; ``stop_reason``: the budget
    it ran out of (``max_turns``, ``context_limit``), None while it has not."""

    run_id: str
    session: Session
    outcome: AgentOutcome | None = None
    future: Any = None  # the agent's, while it plays
    calls: int = 0  # calls to the policy it made
    stop_reason: str | None = None
    calls_past_budget: int = 0

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def failed(self) -> bool:
        return self.outcome is not None and self.outcome.failure is not None

    def sample(self) -> Branch | None:
        """The branch trained on: the one with the most sampled tokens (the latest of equals)."""
        best = None
        for branch in self.session.branches:
            if any(branch.trained) and (best is None or sum(branch.trained) >= sum(best.trained)):
                best = branch
        return best


@dataclass(eq=False)
class AgentGroup:
    group_id: int
    seed: int
    runs: dict[str, AgentRun]
    worker: int
    params: SamplingParams
    training: bool
    size: int
    start_version: int
    closed: bool = False
    complete: bool = False
    ended: list[str] = field(default_factory=list)  # the runs it keeps, once complete

    @property
    def item(self) -> int:
        return self.seed

    @property
    def ready(self) -> bool:
        return self.complete

    def oldest_version(self) -> int:
        versions = [
            v for run in self.runs.values() for b in run.session.branches for v in b.weight_versions if v >= 0
        ]
        return min(versions, default=self.start_version)


@dataclass(eq=False)
class _Call:
    """A call of a run waiting for its result (``await_result``)."""

    group: AgentGroup | None  # None: refused at once (its run had ended)
    result: GenerateResult | None = None
    done: threading.Event = field(default_factory=threading.Event)


class AgentScheduler(GroupScheduler):
    """Plays groups of agent runs through ``backend`` and hands the pipeline their batches; also the
    engine behind the endpoint at ``base_url`` whose sessions live in ``sessions``.

    Args:
        backend: the rollout workers.
        runner: plays the agent program.
        sessions: the endpoint's session store.
        base_url: the endpoint's address (``http://host:port``).
        spec: groups per step, group size, redundancy, time bound, async ratio.
        params: sampling of a training call (``max_new_tokens``: a call's most).
        tasks: the tasks; ``seeds`` the training seeds' order over them.
        pad_id: the tokenizer's pad id.
        id_prefix: starts every request and run id (a scheduler after a recovery needs its own).
        transcript_reward: ``(prompt_ids, reply_ids, task) -> reward`` of a run whose agent returned None
            and posted none: its main branch up to its last reply, and that reply.
    """

    thread_name = "agent-runs"

    def __init__(
        self,
        backend: RolloutBackend,
        runner: AgentRunner,
        sessions: SessionStore,
        base_url: str,
        spec: AgentSpec,
        params: SamplingParams,
        tasks: TaskList,
        seeds: Source,
        pad_id: int,
        id_prefix: str = "",
        poll_s: float = 0.05,
        transcript_reward: Callable[[list[int], list[int], dict[str, Any]], float] | None = None,
    ):
        super().__init__()
        self.backend, self.runner, self.sessions, self.base_url = backend, runner, sessions, base_url
        self.spec, self.params, self.tasks, self.source, self.pad_id = spec, params, tasks, seeds, pad_id
        self.groups_per_batch = spec.groups_per_step
        self.id_prefix, self.poll_s, self.transcript_reward = id_prefix, poll_s, transcript_reward
        self._live: list[AgentGroup] = []  # groups playing (training and evaluation), in draw order
        self._to_start: list[AgentGroup] = []  # evaluation groups waiting for the next pump
        self._run_group: dict[str, AgentGroup] = {}  # live run id (= its session id) -> its group
        self._calls: dict[str, _Call] = {}  # request id -> its call, until its result is taken
        self._outbox: list[GenerateRequest] = []  # calls not yet sent to a worker
        self._sent: set[str] = set()  # request ids sent, not yet back
        self._aborts: list[tuple[int, str]] = []  # (worker, request id) to abort

    # ----- the engine the endpoint calls (from its threads) -----------------------------------------------

    def submit(self, request: GenerateRequest) -> None:
        """A run's call: queued for its group's worker with the run's sampling."""
        if request.cache_key is None:
            raise ValueError(
                "this endpoint trains agents: call it through the session base URL the run was given"
            )
        with self._lock:
            group = self._run_group.get(request.cache_key)
            run = group.runs.get(request.cache_key) if group is not None else None
            live = group is not None and not group.closed and run is not None
            limit = self.spec.max_context_tokens
            room = None if limit is None else limit - len(request.prompt_ids)
            past = "context_limit" if room is not None and room < 1 else None
            if run is not None and run.calls >= self.spec.max_calls:
                past = "max_turns"
            if live and (past is not None or run.stop_reason is not None):
                self._past_budget(group, run, request, past)
            elif live and not run.done:
                run.calls += 1
                call = _Call(group)
                self._calls[request.request_id] = call
                params = _bounded(group.params, request.params, room)
                self._outbox.append(dataclasses.replace(request, params=params))
                self._changed.notify_all()
            else:  # a run that ended (or a closed group): its call is aborted at once
                self._calls[request.request_id] = _Call(None)
                self._resolve(request.request_id, GenerateResult(request.request_id, [], [], "abort"))

    def _past_budget(
        self, group: AgentGroup, run: AgentRun, request: GenerateRequest, past: str | None
    ) -> None:
        """A call the run's budget does not cover: answered at once with nothing sampled, at the length
        limit. The first sets the run's stop reason; a call after that (the agent did not stop) ends it."""
        if run.stop_reason is None:
            run.stop_reason = past
        elif not run.done:
            run.calls_past_budget += 1
        self._calls[request.request_id] = _Call(group)
        self._resolve(request.request_id, GenerateResult(request.request_id, [], [], "length"))
        if run.calls_past_budget and not run.done:
            run.future.cancel()
            run.outcome = self._ran_out(run)
            # Its next call gets a 404 (no retries): a plain function's thread, which cannot be cancelled,
            # ends there instead of calling on until its group closes.
            self.sessions.close(run.run_id)
            self._changed.notify_all()

    def _ran_out(self, run: AgentRun, outcome: AgentOutcome | None = None) -> AgentOutcome:
        """How a run that ran out of its budget ended: the reward its agent gave, else 0."""
        if outcome is not None and outcome.failure is None:
            return outcome
        return AgentOutcome(reward=0.0, error=outcome.error if outcome is not None else None)

    def await_result(self, request_id: str, timeout_s: float | None = None) -> GenerateResult:
        with self._lock:
            call = self._calls.get(request_id)
        if call is None:
            raise KeyError(f"request {request_id!r} is unknown")
        if not call.done.wait(timeout_s):
            raise TimeoutError(f"request {request_id} got no result within {timeout_s} s")
        with self._lock:
            self._calls.pop(request_id, None)
        assert call.result is not None
        return call.result

    def abort(self, request_id: str) -> bool:
        with self._lock:
            call = self._calls.get(request_id)
            if call is None or call.done.is_set():
                return False
            queued = [r for r in self._outbox if r.request_id == request_id]
            if queued:
                self._outbox.remove(queued[0])
                self._resolve(request_id, GenerateResult(request_id, [], [], "abort"))
            elif request_id in self._sent and call.group is not None:
                self._aborts.append((call.group.worker, request_id))
            return True

    def release_prefixes(self, cache_keys: list[str]) -> int:
        """Nothing to do: a run's KV is released when its group ends."""
        return 0

    def _resolve(self, request_id: str, result: GenerateResult) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.result = result
            call.done.set()

    # ----- the pipeline's calls ------------------------------------------------------------------------

    def play(self, seeds: list[int], params: SamplingParams) -> list[AgentRun]:
        """One run per held-out seed, in seed order; a failed run is returned as it ended."""
        with self._lock:
            groups = [self._new_group(seed, 1, params, training=False) for seed in seeds]
            self._to_start += groups
        self._until(lambda: all(group.closed for group in groups) or None)
        return [next(iter(group.runs.values())) for group in groups]

    def close(self) -> None:
        """Stop pumping, end every live group (its runs cancelled, its calls aborted)."""
        self._stop_pumping()
        with self._lock:
            for group in list(self._live):
                try:
                    self._close(group)
                except Exception:  # noqa: BLE001 - a lost worker is the pipeline's to replace
                    self._live = [g for g in self._live if g is not group]
            for request_id in list(self._calls):
                self._resolve(request_id, GenerateResult(request_id, [], [], "abort"))

    # ----- pumping ---------------------------------------------------------------------------------------

    def _pump(self) -> None:
        with self._lock:
            self._drop_stale()
            starting, self._to_start = self._to_start, []
            self._start(starting)
            self._draw()
            self._send()
            generating = bool(self._sent)
        if generating:
            events = self.backend.poll(self.poll_s)
            with self._lock:
                for result in events.generated:
                    self._sent.discard(result.request_id)
                    self._resolve(result.request_id, result)
        else:  # only the agents are working: wait for a call or a run's end
            with self._changed:
                if not self._outbox and not self._any_settled():
                    self._changed.wait(self.poll_s)
        with self._lock:
            self._settle()
            self._changed.notify_all()

    def _open(self, seeds: list[int]) -> list[AgentGroup]:
        size = self.spec.group_size + self.spec.redundancy
        groups = [self._new_group(seed, size, self.params, training=True) for seed in seeds]
        self._start(groups)
        return groups

    def _new_group(self, seed: int, runs: int, params: SamplingParams, training: bool) -> AgentGroup:
        group_id = self._new_group_id()
        ids = [f"{self.id_prefix}g{group_id}r{k}-{uuid.uuid4().hex[:8]}" for k in range(runs)]
        return AgentGroup(
            group_id,
            seed,
            {rid: AgentRun(rid, Session(rid)) for rid in ids},
            worker=group_id % self.backend.num_workers,
            params=params,
            training=training,
            size=self.spec.group_size if training else 1,
            start_version=self.weights_version,
        )

    def _start(self, groups: list[AgentGroup]) -> None:
        """Open each run's session and start its agent."""
        for group in groups:
            self._live.append(group)
            for run in group.runs.values():
                self.sessions.add(run.session)
                self._run_group[run.run_id] = group
                run.future = self.runner.start(
                    dict(self.tasks.task(group.seed)),  # a copy: an agent may change its task
                    f"{self.base_url}/sessions/{run.run_id}/v1",
                    self.spec.timeout_s,
                    lambda run=run, seed=group.seed: self._reward_after(run, seed),
                    lambda outcome, run=run: self._on_done(run, outcome),
                )

    def _reward_after(self, run: AgentRun, seed: int) -> float | None:
        """The reward of a run whose agent returned None: the one it posted, else its transcript scored by
        ``transcript_reward`` (when set)."""
        if run.session.reward is not None or self.transcript_reward is None:
            return run.session.reward
        branch = run.sample()
        if branch is None:
            return None
        last = len(branch.trained) - branch.trained[::-1].index(False) if False in branch.trained else 0
        return self.transcript_reward(branch.token_ids[:last], branch.token_ids[last:], self.tasks.task(seed))

    def _on_done(self, run: AgentRun, outcome: AgentOutcome) -> None:
        with self._lock:
            if run.outcome is None:
                if run.sample() is None:
                    if outcome.failure in (None, "no_reward") or run.stop_reason is not None:
                        error = "the agent never called the policy"
                        if run.stop_reason is not None:
                            error = "its first call's prompt is past env.max_context_tokens"
                        outcome = AgentOutcome(failure="no_calls", error=error)
                elif run.stop_reason is not None:
                    outcome = self._ran_out(run, outcome)
                run.outcome = outcome
            self._changed.notify_all()

    def _send(self) -> None:
        by_worker: dict[int, list[GenerateRequest]] = collections.defaultdict(list)
        for request in self._outbox:
            by_worker[self._calls[request.request_id].group.worker].append(request)
            self._sent.add(request.request_id)
        self._outbox = []
        for worker, requests in by_worker.items():
            self.backend.submit(worker, requests)
        aborts: dict[int, list[str]] = collections.defaultdict(list)
        for worker, request_id in self._aborts:
            aborts[worker].append(request_id)
        self._aborts = []
        for worker, request_ids in aborts.items():
            self.backend.abort(worker, request_ids)

    def _any_settled(self) -> bool:
        """A live group has something to settle: a run that ended since."""
        return any(run.done and not group.closed for group in self._live for run in group.runs.values())

    def _settle(self) -> None:
        """Close the groups that completed or can no longer complete (a training group's place then goes
        to the next task drawn)."""
        for group in list(self._live):
            kept = [rid for rid, run in group.runs.items() if not run.failed][: group.size]
            if len(kept) == group.size and all(group.runs[rid].done for rid in kept):
                group.ended = kept
                self._close(group)
                group.complete = True
            elif len(kept) < group.size:
                self._close(group)
                if not group.training:  # evaluation keeps the failed run
                    continue
                errors = [str(run.outcome.error) for run in group.runs.values() if run.failed and run.outcome]
                self._lose(group, "agent groups", "their runs failed", errors)

    def _close(self, group: AgentGroup) -> None:
        """End the group: cancel its runs still playing, abort their calls, close their sessions."""
        group.closed = True
        self._live.remove(group)
        for run in group.runs.values():
            if not run.done:
                run.future.cancel()
                run.outcome = AgentOutcome(failure="aborted", error="its group ended first")
                if group.training:
                    self._counts["aborted_runs"] += 1
            elif group.training and run.failed:
                self._counts[run.outcome.failure] += 1  # type: ignore[union-attr]
            if group.training:
                self._counts["runs"] += 1
            self.sessions.close(run.run_id)
            self._run_group.pop(run.run_id, None)
        for request_id, call in list(self._calls.items()):
            if call.group is group and not call.done.is_set():
                if request_id in self._sent:
                    self._aborts.append((group.worker, request_id))
                else:
                    self._outbox = [r for r in self._outbox if r.request_id != request_id]
                    self._resolve(request_id, GenerateResult(request_id, [], [], "abort"))
        self.backend.release_prefixes(group.worker, list(group.runs))

    def _drop(self, group: AgentGroup) -> None:
        if not group.closed:
            self._close(group)

    # ----- the batch -------------------------------------------------------------------------------------

    def _batch(self, groups: list[AgentGroup]) -> tuple[Batch, dict[str, float]]:
        with self._lock:
            runs = [group.runs[rid] for group in groups for rid in group.ended]
            group_index = [i for i, group in enumerate(groups) for _ in group.ended]
            seeds = [group.seed for group in groups]
            batch = run_batch(runs, group_index, seeds, self.pad_id, self.spec.stop_policy)
            metrics = run_metrics(runs, "agent")
            metrics.update(self._scheduler_metrics(runs))
            self._counts.clear()
            return batch, metrics

    def _scheduler_metrics(self, runs: list[AgentRun]) -> dict[str, float]:
        counted = max(self._counts.get("runs", 0), 1)
        oldest = [
            min(
                (v for b in run.session.branches for v in b.weight_versions if v >= 0),
                default=self.weights_version,
            )
            for run in runs
        ]
        staleness = [self.weights_version - version for version in oldest]
        metrics = {f"agent/{failure}_frac": self._counts.get(failure, 0) / counted for failure in FAILURES}
        metrics.update(
            {
                "rollout/dropped_groups": float(self._counts.get("dropped_groups", 0)),
                "rollout/aborted_runs": float(self._counts.get("aborted_runs", 0)),
                "rollout/stale_groups": float(self._counts.get("stale_groups", 0)),
                "rollout/staleness_mean": sum(staleness) / max(len(staleness), 1),
                "rollout/staleness_max": float(max(staleness, default=0)),
            }
        )
        return metrics


def run_metrics(runs: list[AgentRun], prefix: str) -> dict[str, float]:
    """Return, success (reward > 0), calls, branches, forks, trained and masked tokens of ``runs`` (failed
    runs count in ``failed_frac`` and as no success)."""
    n = max(len(runs), 1)
    rewards = [run.outcome.reward if run.outcome and run.outcome.reward is not None else 0.0 for run in runs]
    stats = [run.session.stats() for run in runs]
    samples = [run.sample() for run in runs]
    trained = sum(stat["trained_tokens"] for stat in stats)
    masked = sum(stat["masked_tokens"] for stat in stats)
    stops = {f"{prefix}/stop/{why}": sum(run.stop_reason == why for run in runs) / n for why in BUDGETS}
    return {
        **stops,
        f"{prefix}/return": sum(rewards) / n,
        f"{prefix}/success": sum(reward > 0 for reward in rewards) / n,
        f"{prefix}/failed_frac": sum(run.failed for run in runs) / n,
        f"{prefix}/calls": sum(stat["calls"] for stat in stats) / n,
        f"{prefix}/branches": sum(stat["branches"] for stat in stats) / n,
        f"{prefix}/forks": sum(stat["forks"] for stat in stats) / n,
        f"{prefix}/masked_token_frac": masked / max(trained + masked, 1),
        f"{prefix}/untrained_branches": sum(
            sum(1 for b in run.session.branches if b is not sample and any(b.trained))
            for run, sample in zip(runs, samples)
        )
        / n,
    }


def run_batch(
    runs: list[AgentRun],
    group_index: list[int],
    seeds: list[int],
    pad_id: int,
    stop_policy: Mapping[str, str] | None = None,
) -> Batch:
    """One row per run (see the module docstring): prompt left-padded, response right-padded, the loss on
    the sampled tokens, the score the run's reward; a run that ran out of a budget as ``stop_policy``
    says (``mask``: no token trained, ``zero``: scored 0)."""
    prompts, responses, trained, logprobs, scores = [], [], [], [], []
    for run in runs:
        branch = run.sample()
        assert branch is not None  # a run with no sampled token failed (no_calls)
        rule = (stop_policy or {}).get(run.stop_reason or "env_done", "train")  # its agent ended it
        first = branch.trained.index(True)
        prompts.append(branch.token_ids[:first])
        responses.append(branch.token_ids[first:])
        trained.append([flag and rule != "mask" for flag in branch.trained[first:]])
        logprobs.append(branch.logprobs[first:])
        scores.append(0.0 if rule == "zero" else run.outcome.reward)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    response_ids, response_mask = right_pad(responses, pad_id)
    loss_mask = torch.zeros_like(response_mask)
    rollout_logprobs = torch.zeros(response_ids.shape)
    for row, (flags, values) in enumerate(zip(trained, logprobs)):
        loss_mask[row, : len(flags)] = torch.tensor(flags, dtype=loss_mask.dtype)
        rollout_logprobs[row, : len(values)] = torch.tensor(values)
    return Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rollout_logprobs": rollout_logprobs,
            "group_index": torch.tensor(group_index),
            "scores": torch.tensor(scores, dtype=torch.float32),
        },
        non_tensors={
            "seed": [seeds[i] for i in group_index],
            "stop_reason": [run.stop_reason or DONE for run in runs],
            "token_rewards": [None] * len(runs),
            "episode_id": [run.run_id for run in runs],
        },
    )


def demonstrations(scheduler: AgentScheduler, count: int) -> PromptSet:
    """``count`` runs played by ``scheduler`` (over an ``ExpertBackend``: the warm start's), as SFT rows in
    the layout RL trains on: each run's prompt ids, and its response ids with the loss on what was sampled."""
    prompts: list[list[int]] = []
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        batch, _ = scheduler.next_batch(0)
        for row in range(len(batch)):
            n = int(batch["response_mask"][row].sum())
            prompts.append(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist())
            rows.append(
                {
                    "response_ids": batch["response_ids"][row, :n].tolist(),
                    "loss_mask": batch["loss_mask"][row, :n].tolist(),
                }
            )
    return PromptSet(rows[:count], [""] * count, prompts[:count])


def _bounded(run_params: SamplingParams, asked: SamplingParams, room: int | None) -> SamplingParams:
    """The run's sampling for a call that asked for ``asked``: its temperature, top_p and greedy flag,
    at most its tokens per call and the ``room`` its context has left, and the call's stops beside its
    own."""
    stops = tuple(dict.fromkeys((*run_params.stop_token_ids, *asked.stop_token_ids)))
    tokens = min(run_params.max_new_tokens, asked.max_new_tokens, room or asked.max_new_tokens)
    return dataclasses.replace(run_params, max_new_tokens=tokens, stop_token_ids=stops)


class SchedulerEngine:
    """The endpoint's engine in a training run: the run's scheduler of the moment (a recovery makes a new
    one, while the endpoint stays)."""

    scheduler: AgentScheduler | None = None

    def _current(self) -> AgentScheduler:
        if self.scheduler is None:
            raise RuntimeError("no agent scheduler is running (the run is starting or recovering)")
        return self.scheduler

    def submit(self, request: Any) -> None:
        self._current().submit(request)

    def await_result(self, request_id: str, timeout_s: float | None = None) -> Any:
        return self._current().await_result(request_id, timeout_s)

    def abort(self, request_id: str) -> bool:
        return self._current().abort(request_id)

    def release_prefixes(self, cache_keys: Any) -> int:
        return 0
