"""The agent scheduler: groups of agent-program runs (``roll.rollout.agent_runs``) instead of env episodes.

Each training task (a seed of ``TaskList``) gets a group of ``group_size`` runs (plus ``redundancy``), each
with a session of the endpoint (``roll.serving``; the record is ``roll.rollout.sessions``). The endpoint's
engine is this scheduler (``submit``, ``await_result``, ``abort``): a run's calls become requests to its
group's rollout worker, keyed by its session (the engine keeps the KV between its calls), sent and polled by
the pumping thread like every other request. What a run may set is bounded by the run's sampling: the
temperature and top_p are always the run's (``rollout.temperature``; greedy in greedy evaluation), so the
logprobs the trainer recomputes are those of the distribution that sampled; a call may ask for fewer tokens,
and more stops.

- **Groups** and **batches** work as for episodes (``roll.rollout.played_groups``, on
  ``roll.rollout.group_scheduler``): a group is its first ``group_size`` runs in start order that did
  not fail, complete once they all ended; a batch takes the first groups in draw order. Asynchronous
  training and the staleness bound apply as they do there, by the weights versions of a run's sampled
  tokens.
- **Budgets are outcomes.** A run has ``max_calls`` calls to the policy (``env.max_turns``) and
  ``max_context_tokens`` for a call's prompt and reply (``env.max_context_tokens``). The call that would
  pass either is answered at once as an API at its length limit answers: no text, ``finish_reason``
  ``length``. The run ends with that stop reason (``max_turns``, ``context_limit``) once its agent returns,
  or at once when it calls again; an agent that fails after its budget ran out scores 0 (it did not finish
  its task). An agent that fails on a reply cut at its length limit (the Agents SDK raises on an
  incomplete response) ran out of that budget: ``turn_truncated`` (``context_limit`` where the context's
  room cut it), scored 0. It is trained, masked or zeroed as ``stop_policy`` (``env.stop_reasons``) says,
  as an episode is: looping or verbose runs are what GRPO has to learn to avoid, not infrastructure failures.
- **Failures.** A run whose agent raised, ran past ``timeout_s``, never called the policy, or ended with
  no reward failed: its place in the group goes to the next run, and a group that can no longer
  complete is dropped and the next task drawn in its place (``agent/*_frac``, ``rollout/dropped_groups``);
  more than ``max_dropped_groups`` in one step stop the run, naming the agent's last error. A failed
  run is never trained on, and never scored 0.
- **Samples** (``roll.rollout.agent_rows``). Trajectory-wise, a row per trained branch of a run's session
  (``roll.rollout.sessions``): the one with the most sampled tokens, or every one with ``train_branches``
  ``all`` (a sub-agent's context, an edited history), each with the run's reward and counted once per run
  in its group's baseline. A branch's tokens up to its first sampled one are the prompt; the rest is the
  response, the sampled tokens trained and every other (tool results, the next user turn, a fork's
  unproven tokens) masked.
- **A hung run holds up only its group** with spare groups (``spare_groups``: the warm start's, and
  ``agent.spare_groups``) or asynchronously: a batch takes the first *ready* groups in draw order; those
  it passes over go into a later batch within the staleness bound (synchronously: none, so they are
  dropped once the weights move and their tasks drawn again first). Without either a batch is the first
  groups in draw order, and a hung run holds its step up to ``timeout_s``. The endpoint-facing calls are
  ``roll.rollout.agent_calls``.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from roll.data.batch import Batch
from roll.rollout.agent_calls import EndpointCalls, SchedulerEngine, _Call
from roll.rollout.agent_rows import (
    BUDGETS,
    DONE,
    FAILURES,
    AgentRun,
    demonstrations,
    run_batch,
    run_metrics,
    scheduler_metrics,
)
from roll.rollout.agent_runs import AgentOutcome, AgentRunner, TaskList
from roll.rollout.backend import RolloutBackend
from roll.rollout.group_scheduler import Source
from roll.rollout.played_groups import PlayedGroup, PlayedGroupScheduler
from roll.rollout.sessions import Session, SessionStore
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

__all__ = ["AgentGroup", "AgentRun", "AgentScheduler", "AgentSpec", "SchedulerEngine", "demonstrations"]
__all__ += ["run_batch", "run_metrics"]

logger = logging.getLogger(__name__)
clock: Callable[[], float] = time.monotonic  # of the progress lines (a test steps it)


@dataclass(frozen=True)
class AgentSpec:
    """``groups_per_step`` tasks per batch, ``group_size`` runs each (+ ``redundancy``), each within
    ``timeout_s``, ``max_calls`` calls to the policy and ``max_context_tokens`` a call (None: unbounded
    here); ``stop_policy``: stop reason -> train, mask or zero (``env.stop_reasons``);
    ``async_generation_ratio`` as for episodes. ``spare_groups``: groups played beyond the batch's, the
    batch then taking the first ready groups in draw order (a slow or hung run holds up only its own
    group). ``train_branches``: ``longest`` or ``all``; with ``all`` a batch is padded to a multiple of
    ``divisor`` rows (the actor's ranks times its mini-batches)."""

    groups_per_step: int
    group_size: int
    timeout_s: float
    max_calls: int = 1 << 30
    max_context_tokens: int | None = None
    redundancy: int = 0
    async_generation_ratio: int = 0
    stop_policy: Mapping[str, str] = field(default_factory=dict)
    spare_groups: int = 0
    train_branches: str = "longest"
    divisor: int = 1

    @property
    def max_dropped_groups(self) -> int:
        """Groups dropped in one step before the step fails (as ``EpisodeSpec``'s)."""
        return 4 * self.groups_per_step + 8


AgentGroup = PlayedGroup[AgentRun]  # a task's runs (``members``)


class AgentScheduler(EndpointCalls, PlayedGroupScheduler[AgentRun]):
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
        progress_every_s: float = 0.0,
    ):
        super().__init__()
        self.backend, self.runner, self.sessions, self.base_url = backend, runner, sessions, base_url
        self.spec, self.params, self.tasks, self.source, self.pad_id = spec, params, tasks, seeds, pad_id
        self.groups_per_batch = spec.groups_per_step
        # Asynchronously the groups a batch passes over play on and go into a later batch (within the
        # staleness bound), so a batch may take the ready ones: a hung run then holds up only its group.
        self.extra_groups = spec.spare_groups
        self.in_draw_order = not (spec.spare_groups or spec.async_generation_ratio)
        self.id_prefix, self.poll_s, self.transcript_reward = id_prefix, poll_s, transcript_reward
        self._run_group: dict[str, AgentGroup] = {}  # live run id (= its session id) -> its group
        self._calls: dict[str, _Call] = {}  # request id -> its call, until its result is taken
        self._outbox: list[GenerateRequest] = []  # calls not yet sent to a worker
        self._sent: set[str] = set()  # request ids sent, not yet back
        self._aborts: list[tuple[int, str]] = []  # (worker, request id) to abort
        self.progress_every_s = progress_every_s
        self._ended: collections.Counter[str] = collections.Counter()  # runs ended, by how (progress lines)
        self._next_progress = clock() + progress_every_s

    # ----- the pipeline's calls ------------------------------------------------------------------------

    def _after_close(self) -> None:
        for request_id in list(self._calls):  # the calls of runs cancelled with their group
            self._resolve(request_id, GenerateResult(request_id, [], [], "abort"))

    # ----- pumping ---------------------------------------------------------------------------------------

    def _pump(self) -> None:
        with self._lock:
            self._begin_round()
            generating = bool(self._sent)
        if generating:
            events = self.backend.poll(self.poll_s)
            with self._lock:
                for result in events.generated:
                    self._sent.discard(result.request_id)
                    self._sampled(result)
        else:  # only the agents are working: wait for a call or a run's end
            with self._changed:
                if not self._outbox and not self._any_settled():
                    self._changed.wait(self.poll_s)
        with self._lock:
            self._settle_live()
            self._changed.notify_all()
            self._report_progress()

    def _report_progress(self) -> None:
        """Every ``progress_every_s`` (0: never), one line: runs ended (failed, by reason; out of a
        budget), and playing, so that a phase waiting on slow or hung runs is not silent."""
        now = clock()
        if self.progress_every_s <= 0 or now < self._next_progress:
            return
        self._next_progress = now + self.progress_every_s
        playing = sum(not run.done for group in self._live for run in group.members.values())
        how = [f"{self._ended[why]} {why}" for why in (*FAILURES, *BUDGETS, "aborted") if self._ended[why]]
        how_text = ", ".join(how) or "none failed"
        logger.info("agent runs: %d ended (%s), %d playing", self._ended["runs"], how_text, playing)

    def _is_stale(self, group: AgentGroup) -> bool:  # type: ignore[override]
        """As the base says, and synchronously too: a spare group a batch passed over holds the last
        weights' tokens once they move, so it is dropped and its task drawn again."""
        oldest = group.oldest_version()
        return oldest < self.stale_before()

    def _members(self, group_id: int, seed: int, count: int) -> dict[str, AgentRun]:
        ids = [f"{self.id_prefix}g{group_id}r{k}-{uuid.uuid4().hex[:8]}" for k in range(count)]
        return {rid: AgentRun(rid, Session(rid)) for rid in ids}

    def _start(self, groups: list[AgentGroup]) -> None:
        """Open each run's session and start its agent."""
        for group in groups:
            self._live.append(group)
            for run in group.members.values():
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
                elif run.stop_reason is None and outcome.failure in ("agent_error", "no_reward") and run.cut:
                    run.stop_reason = run.cut  # it failed on a reply cut short: the policy's doing
                    outcome = self._ran_out(run, outcome)
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
        return any(run.done and not group.closed for group in self._live for run in group.members.values())

    def _settle_live(self) -> None:
        """Close the groups that completed or can no longer complete (a training group's place then goes
        to the next task drawn)."""
        for group in list(self._live):
            self._settle(group, "agent groups", "their runs failed")

    def _close(self, group: AgentGroup) -> None:
        """End the group: cancel its runs still playing, abort their calls, close their sessions."""
        group.closed = True
        self._live.remove(group)
        for run in group.members.values():
            if not run.done:
                run.future.cancel()
                run.outcome = AgentOutcome(failure="aborted", error="its group ended first")
                if group.training:
                    self._counts["aborted_runs"] += 1
            elif group.training and run.failed:
                self._counts[run.outcome.failure] += 1  # type: ignore[union-attr]
            if group.training:
                self._counts["runs"] += 1
            self._ended["runs"] += 1
            self._ended[run.outcome.failure or run.stop_reason or DONE] += 1  # type: ignore[union-attr]
            self.sessions.close(run.run_id)
            self._run_group.pop(run.run_id, None)
        for request_id, call in list(self._calls.items()):
            if call.group is group and not call.done.is_set():
                if request_id in self._sent:
                    self._aborts.append((group.worker, request_id))
                else:
                    self._outbox = [r for r in self._outbox if r.request_id != request_id]
                    self._resolve(request_id, GenerateResult(request_id, [], [], "abort"))
        self.backend.release_prefixes(group.worker, list(group.members))

    # ----- the batch -------------------------------------------------------------------------------------

    def _batch(self, groups: list[AgentGroup]) -> tuple[Batch, dict[str, float]]:
        with self._lock:
            runs = [group.members[rid] for group in groups for rid in group.ended]
            group_index = [i for i, group in enumerate(groups) for _ in group.ended]
            seeds = [group.seed for group in groups]
            spec, every = self.spec, self.spec.train_branches == "all"
            batch = run_batch(runs, group_index, seeds, self.pad_id, spec.stop_policy, every, spec.divisor)
            metrics = {**run_metrics(runs, "agent", every), **self.runner.blocked_metrics()}
            metrics.update(scheduler_metrics(runs, self._counts, self.weights_version))
            if every:
                metrics["agent/rows_per_run"] = float((~batch["padding"]).sum()) / max(len(runs), 1)
            self._counts.clear()
            return batch, metrics
