"""The episode scheduler: owns each episode's lifecycle (generate -> env step -> generate) and hands the
agentic pipeline full training batches: one sample per episode, or step-wise one per turn
(``roll.rollout.episode_batch``).

- **No barrier between episodes.** Each turn is one engine request carrying the episode so far (or its
  step-wise window), sent as soon as the episode's last observation is in; whichever turns come back are
  stepped in their environments together (one call per environment worker), and their next turns go out
  at once.
- **Groups.** The episodes of one seed form a group of ``group_size`` (GRPO compares them).
  ``redundancy`` starts extra episodes per group, which stand in for episodes whose env fails: the
  group is its first ``group_size`` episodes in start order that did not fail, complete once they have
  all ended, and the rest are aborted. Keeping the first to *end* instead would favour short episodes
  (quick failures, quick successes) in every group's baseline. Likewise a batch takes the first
  ``groups_per_step`` groups *in the order their seeds were drawn*, once all of them are complete.
- **Failures.** An environment that raises or hangs has been retried once by its pool (see
  ``roll.envs.pool``); if it failed again, its episode is dropped. A group that can no longer complete
  is dropped and a new seed is drawn in its place, and the counters (``env/error_frac``,
  ``env/timeout_frac``, ``rollout/dropped_groups``) say what happened. A failing env costs episodes, not
  the run, up to a bound: once more than ``EpisodeSpec.max_dropped_groups`` groups are dropped in one
  step (``4 x groups_per_step + 8``, ``groups_per_step`` being ``rollout.rollout_batch_size``), the step
  raises, naming the env's last error, and the run stops.
- **Lost workers.** Nothing under the scheduler's lock waits for a worker: env resets and steps, like
  turns, are sent there and their results polled outside it, and closes are only sent. A worker that
  dies or freezes fails the poll waiting on it (a frozen one at ``ray.liveness_timeout_s``) with its
  own ``WorkerError``, which ``next_batch`` raises for the pipeline to replace the worker; meanwhile
  the pipeline's other calls (``state_dict``, ``close``) answer at once.
- **Stop reasons.** ``stop_policy`` says per reason whether an episode is trained on as is (``train``),
  kept in its group's baseline with no token trained (``mask``), or trained with return 0 (``zero``).
- **Synchronous** (``async_generation_ratio`` 0): episodes are played only inside ``next_batch``;
  nothing generates or steps while the actor trains.
- **Asynchronous** (ratio r > 0): a background thread keeps playing the groups of the next r steps
  while the actor trains, generating turns and stepping environments alike. Every token records the
  weights version that sampled it, so a turn may start on newer weights than the turn before it; once
  the weights move to version v (``set_weights_version``), a group holding a token older than v - r (or,
  before its first token, started before then) is aborted and its seed drawn again: no trained episode
  is more than r versions old.

Like ``RolloutScheduler`` it talks to the workers through a ``RolloutBackend`` (and the environments
through an ``EnvClient``), so tests drive it with fakes and no Ray.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from roll.data.batch import Batch
from roll.data.chat_turns import ChatTurns
from roll.envs.pool import ERROR, OK, EnvResult
from roll.envs.seeds import SeedOrder
from roll.rollout.backend import RolloutBackend
from roll.rollout.env_clients import EnvCalls, EnvClient
from roll.rollout.episode import Episode, StopReason
from roll.rollout.episode_batch import trajectory_batch, turn_batch
from roll.rollout.episode_group import EpisodeGroup, EpisodeSpec
from roll.rollout.episode_metrics import episode_metrics, scheduler_metrics
from roll.rollout.played_groups import PlayedGroupScheduler
from roll.rollout.tool_calls import ToolFailureMonitor
from roll.strategies.requests import GenerateRequest, SamplingParams

__all__ = ["EpisodeScheduler", "EpisodeSpec", "episode_metrics"]

# How long a poll for turns waits while env steps are out too (their results are taken after it).
ENV_POLL_S = 0.005


class EpisodeScheduler(PlayedGroupScheduler[Episode]):
    """Episodes of the training seeds, played through ``backend`` (generation) and ``envs``.

    Args:
        backend: generation on the rollout workers (its ``score`` is never used: the env scores).
        envs: the environments of the live episodes.
        chat: the tokenizer's chat template, turn by turn.
        spec: groups per step, group size, redundancy, budgets, stop policy, layout, async ratio.
        params: sampling parameters of a training turn (``max_new_tokens``: the per-turn budget).
        seeds: the training seeds' order.
        pad_id: the tokenizer's pad id.
        id_prefix: starts every request and episode id (a scheduler after a recovery needs its own).
        poll_s: how long one poll waits for turns to come back.
    """

    thread_name = "episodes"
    group_type = EpisodeGroup

    def __init__(
        self,
        backend: RolloutBackend,
        envs: EnvClient,
        chat: ChatTurns,
        spec: EpisodeSpec,
        params: SamplingParams,
        seeds: SeedOrder,
        pad_id: int,
        id_prefix: str = "",
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__()
        self._env_calls = EnvCalls(envs, clock)
        self.backend, self.chat, self.spec = backend, chat, spec
        self.params, self.source, self.pad_id = params, seeds, pad_id
        self.groups_per_batch = spec.groups_per_step
        self.id_prefix, self.poll_s, self.clock = id_prefix, poll_s, clock
        self._requests: dict[str, tuple[EpisodeGroup, str]] = {}  # request id -> (group, episode id)
        self._group_of: dict[str, EpisodeGroup] = {}  # live episode id -> its group
        self._env_seconds: list[float] = []
        self._tools = ToolFailureMonitor(spec.max_tool_failure_frac)

    @property
    def envs(self) -> EnvClient:
        """The environments of the live episodes."""
        return self._env_calls.envs

    @envs.setter
    def envs(self, envs: EnvClient) -> None:
        self._env_calls.envs = envs

    # ----- the pipeline's calls ------------------------------------------------------------------------

    def _after_close(self) -> None:
        self._env_calls.close_held()  # on a lost worker they never run

    # ----- pumping ---------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """One round: drop stale groups, draw the groups wanted, send the turns waiting, wait for turns
        or env resets and steps to come back, and react to them. Every call to a worker under the lock
        only sends; the waits run outside it, so the pipeline's calls never wait for a worker."""
        with self._lock:
            self._begin_round()
            generating = bool(self._requests)
        touched = []
        if generating or not self.envs.pending:
            # Turns are generating: wait for them, then take whatever env steps came back meanwhile.
            events = self.backend.poll(self.poll_s if not self.envs.pending else ENV_POLL_S)
            with self._lock:
                touched += self._on_generated(events.generated)
            answered = self.envs.poll(0.0)
        else:  # only env resets and steps are out: wait for them
            answered = self.envs.poll(self.poll_s)
        with self._lock:
            touched += self._on_env(answered)
            self._settle_touched(dict.fromkeys(touched))
            self._changed.notify_all()

    def _members(self, group_id: int, seed: int, count: int) -> dict[str, Episode]:
        budget, history = self.spec.budget, self.spec.history_turns
        ids = [f"{self.id_prefix}g{group_id}e{k}" for k in range(count)]
        return {eid: Episode(None, seed, self.chat, budget, history) for eid in ids}

    def _start(self, groups: list[EpisodeGroup]) -> None:
        """Send the resets of the groups' environments (one call per env worker); each episode starts
        when its reset comes back (``_on_env``)."""
        self._live += groups
        self._group_of.update({eid: group for group in groups for eid in group.members})
        requests = [(eid, group.seed) for group in groups for eid in group.members]
        if requests:
            self._env_calls.reset(requests)

    def _send(self) -> None:
        """The next turn of every live episode waiting for one."""
        in_flight = {eid for _, eid in self._requests.values()}
        by_worker: dict[int, list[GenerateRequest]] = collections.defaultdict(list)
        for group in self._live:
            for eid, episode in group.members.items():
                if eid in in_flight or self._env_calls.waiting(eid) or episode.done:
                    continue
                context, room = episode.next_request()
                request_id = f"{eid}t{len(episode.turns)}"
                vision = episode.vision_inputs(episode.turn_images(len(episode.turns)))
                # The episode id keys the engine's kept KV: turn k prefills only what follows turn k-1. A
                # step-wise window does not extend the one before it, and the hf engine prefills image
                # prompts whole: nothing to keep.
                key = eid if self.spec.history_turns is None and vision is None else None
                request = GenerateRequest(
                    request_id, context, _within(group.params, room), cache_key=key, vision=vision
                )
                by_worker[group.worker].append(request)
                self._requests[request_id] = (group, eid)
        for worker, requests in by_worker.items():
            self.backend.submit(worker, requests)

    def _on_generated(self, results: list[Any]) -> list[EpisodeGroup]:
        """Append each finished turn to its episode and send the env steps of those that go on."""
        actions, touched = [], []
        for result in results:
            owner = self._requests.pop(result.request_id, None)
            if owner is None:
                continue  # an aborted turn of a group that ended
            group, eid = owner
            episode = group.members[eid]
            versions = result.weight_versions or [self.weights_version] * len(result.token_ids)
            action = episode.add_turn(result.token_ids, result.logprobs, versions, result.finish_reason)
            if action is not None:
                actions.append((eid, action))
            touched.append(group)
        if actions:
            self._env_calls.step(actions)
        return touched

    def _on_env(self, results: list[EnvResult]) -> list[EpisodeGroup]:
        """The env's answers to resets and steps: an episode started, its observation appended, or the
        episode ended by its env's failure."""
        touched = []
        for result, seconds in self._env_calls.answered(results):
            group = self._group_of.get(result.episode_id)
            if group is None:
                continue
            episode = group.members[result.episode_id]
            self._count_env(result, group)
            if result.status != OK:
                episode.end(_failure(result), RuntimeError(result.error))
            elif seconds is None:  # a reset
                episode.start(result.observation)
            else:
                episode.observe(
                    result.observation, result.reward, result.terminated, result.truncated, result.info
                )
            if seconds is not None and group.training:
                self._env_seconds.append(seconds)
            touched.append(group)
        return touched

    def _settle_touched(self, groups: Any) -> None:
        """Note the episodes of ``groups`` that ended; close the groups that completed or can no longer
        complete (a training group's seed is then replaced by the next draw)."""
        for group in list(groups):
            if group.closed:
                continue
            ended = [eid for eid, e in group.members.items() if e.done and eid not in group.released]
            if ended:  # the KV the engine kept for their next turn is freed now
                self.backend.release_prefixes(group.worker, ended)
                group.released.update(ended)
            self._settle(group, "episode groups", "their environment failed")

    def _close(self, group: EpisodeGroup) -> None:
        """End the group: abort its turns in flight, end its unfinished episodes (redundant ones, or those
        of a dropped group) and close its environments."""
        group.closed = True
        self._live.remove(group)
        aborted = [rid for rid, (g, _) in self._requests.items() if g is group]
        for request_id in aborted:
            del self._requests[request_id]
        if aborted:
            self.backend.abort(group.worker, aborted)
        # Episodes still generating or waiting for their env: their results will be ignored.
        unfinished = [episode for episode in group.members.values() if not episode.done]
        kept = [eid for eid in group.members if eid not in group.released]
        if kept:
            self.backend.release_prefixes(group.worker, kept)
        for episode in unfinished:
            episode.end(StopReason.ABORTED)
        if group.training:
            self._counts["aborted_episodes"] += len(unfinished)
        self._env_calls.close(group.members)
        for eid in group.members:
            self._group_of.pop(eid, None)

    def _count_env(self, result: EnvResult, group: EpisodeGroup) -> None:
        """Count a training episode's env call (evaluation's would blur the step's rates)."""
        if not group.training:
            return
        self._counts["env_calls"] += 1
        self._counts["env_retried"] += result.retried
        if result.status != OK:
            self._counts["env_errors" if result.status == ERROR else "env_timeouts"] += 1

    # ----- the batch -------------------------------------------------------------------------------------

    def _batch(self, groups: list[EpisodeGroup]) -> tuple[Batch, dict[str, float]]:
        with self._lock:
            return self._episode_batch(groups)

    def _episode_batch(self, groups: list[EpisodeGroup]) -> tuple[Batch, dict[str, float]]:
        spec = self.spec
        rows = [(group, eid) for group in groups for eid in group.ended[: spec.group_size]]
        episodes = [group.members[eid] for group, eid in rows]
        group_index = [i for i, _ in enumerate(groups) for _ in range(spec.group_size)]
        ids = [eid for _, eid in rows]
        self._tools.observe(episodes)
        metrics = self._metrics(episodes)
        if spec.history_turns is None:
            return trajectory_batch(episodes, group_index, ids, spec.stop_policy, self.pad_id), metrics
        batch = turn_batch(episodes, group_index, ids, spec.stop_policy, self.pad_id, spec.divisor)
        metrics["rollout/turn_samples"] = float((~batch["padding"]).sum())
        metrics["rollout/padding_samples"] = float(batch["padding"].sum())
        return batch, metrics

    def _metrics(self, episodes: list[Episode]) -> dict[str, float]:
        """The batch's episode metrics, and what the env calls, drops and aborts since the last batch."""
        metrics = episode_metrics(episodes, "episode")
        metrics.update(scheduler_metrics(episodes, self._counts, self._env_seconds, self.weights_version))
        self._counts.clear()
        self._env_seconds.clear()
        return metrics


def _within(params: SamplingParams, room: int) -> SamplingParams:
    """``params`` for a turn with ``room`` tokens left (fewer than a turn's budget near the context end)."""
    return params if room >= params.max_new_tokens else dataclasses.replace(params, max_new_tokens=room)


def _failure(result: EnvResult) -> StopReason:
    return StopReason.ENV_ERROR if result.status == ERROR else StopReason.ENV_TIMEOUT
