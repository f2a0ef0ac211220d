"""The endpoint-facing half of the agent scheduler: the engine the endpoint's threads call (``submit``,
``await_result``, ``abort``) and how a run's budgets answer a call (``roll.rollout.agent_scheduler`` has
the rest). ``SchedulerEngine`` is what the endpoint holds: the scheduler of the moment."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from roll.rollout.agent_rows import AgentRun
from roll.rollout.agent_runs import AgentOutcome
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

if TYPE_CHECKING:
    from roll.rollout.agent_scheduler import AgentGroup, AgentScheduler

__all__ = ["EndpointCalls", "SchedulerEngine"]


@dataclass(eq=False)
class _Call:
    """A call of a run waiting for its result (``await_result``)."""

    group: AgentGroup | None  # None: refused at once (its run had ended)
    run: AgentRun | None = None  # sampled for: its reply's length limit is the run's
    cut_by: str = "turn_truncated"  # the budget a reply stopped at its length limit ran out of
    result: GenerateResult | None = None
    done: threading.Event = field(default_factory=threading.Event)


class EndpointCalls:
    """The calls of runs, as the endpoint makes them: queued for the run's group's worker with the run's
    sampling, or answered at once (a spent budget, an ended run). Mixed into ``AgentScheduler``, whose
    state (``_lock``, ``_run_group``, ``_calls``, ``_outbox``, ...) it reads and changes under its lock."""

    def submit(self, request: GenerateRequest) -> None:
        """A run's call: queued for its group's worker with the run's sampling."""
        if request.cache_key is None:
            raise ValueError(
                "this endpoint trains agents: call it through the session base URL the run was given"
            )
        with self._lock:
            group = self._run_group.get(request.cache_key)
            run = group.members.get(request.cache_key) if group is not None else None
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
                call = _Call(group, run)
                self._calls[request.request_id] = call
                params = _bounded(group.params, request.params, room)
                if room is not None and params.max_new_tokens == room < group.params.max_new_tokens:
                    call.cut_by = "context_limit"  # the room left, not the tokens a reply gets, bounds it
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

    def _sampled(self, result: GenerateResult) -> None:
        """A call's result from a worker: its run notes whether the reply stopped at its length limit
        (an agent that fails on such a reply ran out of that budget: ``_on_done``)."""
        call = self._calls.get(result.request_id)
        if call is not None and call.run is not None and result.token_ids:
            call.run.cut = call.cut_by if result.finish_reason == "length" else None
        self._resolve(result.request_id, result)

    def _resolve(self, request_id: str, result: GenerateResult) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.result = result
            call.done.set()


def _bounded(run_params: SamplingParams, asked: SamplingParams, room: int | None) -> SamplingParams:
    """The run's sampling for a call that asked for ``asked``: its temperature, top_p and greedy flag,
    at most its tokens per call and the ``room`` its context has left, and the call's stops beside its
    own."""
    stops = tuple(dict.fromkeys((*run_params.stop_token_ids, *asked.stop_token_ids)))
    texts = tuple(dict.fromkeys((*run_params.stop, *asked.stop)))
    tokens = min(run_params.max_new_tokens, asked.max_new_tokens, room or asked.max_new_tokens)
    return dataclasses.replace(run_params, max_new_tokens=tokens, stop_token_ids=stops, stop=texts)


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
