"""The episode scheduler: owns each episode's lifecycle (generate -> env step -> generate) and hands the
agentic pipeline full training batches, one episode per sample.

- **No barrier between episodes.** Each turn is one engine request carrying the episode so far, sent as
  soon as the episode's last observation is in; whichever turns come back are stepped in their
  environments together (one call per environment worker), and their next turns go out at once.
- **Groups.** The episodes of one seed form a group of ``group_size`` (GRPO compares them).
  ``redundancy`` starts extra episodes per group; the first ``group_size`` to end complete it and the
  rest are aborted.
- **Failures.** An environment that raises or hangs has been retried once by its pool (see
  ``roll.envs.pool``); if it failed again, its episode is dropped. A group that can no longer complete
  is dropped and a new seed is drawn in its place: no env failure stops the run, and the counters
  (``env/error_frac``, ``env/timeout_frac``, ``rollout/dropped_groups``) say what happened. Only when
  far more groups fail than a step wants does the step stop, naming the env's last error.
- **Stop reasons.** ``stop_policy`` says per reason whether an episode is trained on as is (``train``),
  kept in its group's baseline with no token trained (``mask``), or trained with return 0 (``zero``).

Like ``RolloutScheduler`` it talks to the workers through a ``RolloutBackend`` (and the environments
through an ``EnvClient``), so tests drive it with fakes and no Ray.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.data.batch import Batch
from roll.data.chat_turns import ChatTurns
from roll.data.padding import left_pad, right_pad
from roll.envs.pool import ERROR, OK, EnvResult
from roll.envs.seeds import SeedOrder
from roll.rollout.backend import RolloutBackend
from roll.rollout.env_clients import EnvClient
from roll.rollout.episode import Episode, EpisodeBudget, StopReason, Turn
from roll.strategies.infer.base import GenerateRequest
from roll.strategies.sampling import SamplingParams

__all__ = ["EpisodeScheduler", "EpisodeSpec", "episode_metrics"]

# How long a poll for turns waits while env steps are out too (their results are taken after it).
ENV_POLL_S = 0.005
# At most this many distinct actions get a histogram entry (a policy writing free text would make one
# per turn); the rest are counted under actions/other.
MAX_ACTION_KEYS = 16


@dataclass(frozen=True)
class EpisodeSpec:
    """What one step gathers: ``groups_per_step`` groups of ``group_size`` episodes (``redundancy``
    extra started per group), each within ``budget``."""

    groups_per_step: int
    group_size: int
    budget: EpisodeBudget
    redundancy: int = 0
    stop_policy: Mapping[str, str] = field(default_factory=dict)  # stop reason -> train, mask or zero

    @property
    def max_dropped_groups(self) -> int:
        """Dropped groups one step tolerates before it stops with the env's error."""
        return 4 * self.groups_per_step + 8


@dataclass(eq=False)  # identity: a group is one object
class _Group:
    group_id: int
    seed: int
    episodes: dict[str, Episode]
    worker: int
    training: bool  # a training seed's group (not a held-out episode of the evaluation)
    ended: list[str] = field(default_factory=list)  # episodes that ended as samples, in order
    closed: bool = False


class EpisodeScheduler:
    """Episodes of the training seeds, played through ``backend`` (generation) and ``envs``.

    Args:
        backend: generation on the rollout workers (its ``score`` is never used: the env scores).
        envs: the environments of the live episodes.
        chat: the tokenizer's chat template, turn by turn.
        spec: groups per step, group size, redundancy, budgets, stop policy.
        params: sampling parameters of a training turn (``max_new_tokens``: the per-turn budget).
        seeds: the training seeds' order.
        pad_id: the tokenizer's pad id.
        id_prefix: starts every request and episode id (a scheduler after a recovery needs its own).
        poll_s: how long one poll waits for turns to come back.
    """

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
        self.backend, self.envs, self.chat, self.spec = backend, envs, chat, spec
        self.params, self.seeds, self.pad_id = params, seeds, pad_id
        self.id_prefix, self.poll_s, self.clock = id_prefix, poll_s, clock
        self.weights_version = 0
        self._next_group = 0
        self._requests: dict[str, tuple[_Group, str]] = {}  # request id -> (group, episode id)
        self._live: list[_Group] = []
        self._group_of: dict[str, _Group] = {}  # live episode id -> its group
        self._stepping: dict[str, float] = {}  # episode id -> when its env step was sent
        self._counts: collections.Counter[str] = collections.Counter()
        self._env_seconds: list[float] = []

    # ----- the pipeline's calls ------------------------------------------------------------------------

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The next training batch (``groups_per_step`` complete groups) and its episode metrics."""
        self._counts.clear()
        self._env_seconds.clear()
        spec = self.spec
        groups = self._run(
            [
                self._new_group(self.seeds.next(), spec.group_size + spec.redundancy, training=True)
                for _ in range(spec.groups_per_step)
            ],
            spec.groups_per_step,
            self.params,
            spec.group_size,
            replace=lambda: self._new_group(self.seeds.next(), spec.group_size + spec.redundancy, True),
        )
        rows = [(group, eid) for group in groups for eid in group.ended[: spec.group_size]]
        episodes = [group.episodes[eid] for group, eid in rows]
        group_index = [i for i, _ in enumerate(groups) for _ in range(spec.group_size)]
        batch = self._assemble(episodes, group_index)
        batch["episode_id"] = [eid for _, eid in rows]
        return batch, self._metrics(episodes)

    def play(self, seeds: Sequence[int], params: SamplingParams) -> list[Episode]:
        """One episode per seed (held-out evaluation), in seed order; an episode whose env failed is
        returned as it ended (``failed``)."""
        groups = [self._new_group(seed, 1, training=False) for seed in seeds]
        self._run(groups, len(groups), params, 1, replace=None)
        return [next(iter(group.episodes.values())) for group in groups]

    def set_weights_version(self, version: int) -> None:
        self.weights_version = version

    def state_dict(self) -> dict[str, Any]:
        """The seed cursor; the seeds of groups drawn and not trained on are drawn again first (never a
        held-out seed of an evaluation cut short)."""
        state = self.seeds.state_dict()
        state["pending"] = [group.seed for group in self._live if group.training] + state["pending"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._live:
            raise RuntimeError("load_state_dict must come before the scheduler plays any episode")
        self.seeds.load_state_dict(state)

    def close(self) -> None:
        """Abort every turn in flight and close the live episodes' environments, as far as the workers
        still answer (after a loss, or at shutdown, they may be gone)."""
        for group in list(self._live):
            try:
                self._close(group)
            except Exception:  # noqa: BLE001 - a lost worker is the pipeline's to replace, not close's
                self._live = [g for g in self._live if g is not group]

    # ----- playing ---------------------------------------------------------------------------------------

    def _new_group(self, seed: int, episodes: int, training: bool) -> _Group:
        group_id = self._next_group
        self._next_group += 1
        ids = [f"{self.id_prefix}g{group_id}e{k}" for k in range(episodes)]
        return _Group(
            group_id,
            seed,
            {eid: Episode(None, seed, self.chat, self.spec.budget) for eid in ids},
            worker=group_id % self.backend.num_workers,
            training=training,
        )

    def _run(
        self,
        groups: list[_Group],
        wanted: int,
        params: SamplingParams,
        group_size: int,
        replace: Callable[[], _Group] | None,
    ) -> list[_Group]:
        """Play ``groups`` until ``wanted`` are complete (``group_size`` episodes ended in each), drawing
        a new group for each one dropped when ``replace`` is given; returns the complete ones in the
        order they completed."""
        complete: list[_Group] = []
        self._start(groups)
        self._settle(groups, complete, group_size, replace)
        while len(complete) < wanted:
            if not self._live:
                break  # evaluation: every group ended (failed ones included)
            self._send(params)
            touched: list[_Group] = []
            if self._requests or not self.envs.pending:
                # Turns are generating: wait for them, then take whatever env steps came back meanwhile.
                events = self.backend.poll(self.poll_s if not self.envs.pending else ENV_POLL_S)
                touched += self._on_generated(events.generated)
                touched += self._on_stepped(self.envs.poll(0.0))
            else:  # only env steps are out: wait for them
                touched += self._on_stepped(self.envs.poll(self.poll_s))
            self._settle(dict.fromkeys(touched), complete, group_size, replace)
        return complete

    def _on_generated(self, results: list[Any]) -> list[_Group]:
        """Append each finished turn to its episode and send the env steps of those that go on."""
        actions, touched = [], []
        for result in results:
            owner = self._requests.pop(result.request_id, None)
            if owner is None:
                continue  # an aborted turn of a group that ended
            group, eid = owner
            episode = group.episodes[eid]
            versions = result.weight_versions or [self.weights_version] * len(result.token_ids)
            action = episode.add_turn(result.token_ids, result.logprobs, versions, result.finish_reason)
            if action is not None:
                actions.append((eid, action))
                self._stepping[eid] = self.clock()
            touched.append(group)
        if actions:
            self.envs.send(actions)
        return touched

    def _on_stepped(self, results: list[EnvResult]) -> list[_Group]:
        """The env's answers: observations appended, or the episode ended by its env's failure."""
        touched = []
        now = self.clock()
        for result in results:
            group = self._group_of.get(result.episode_id)
            sent = self._stepping.pop(result.episode_id, None)
            if group is None or sent is None:
                continue  # the group ended meanwhile (its other episodes completed it)
            self._env_seconds.append(now - sent)
            episode = group.episodes[result.episode_id]
            self._count_env(result)
            if result.status == OK:
                episode.observe(
                    result.observation, result.reward, result.terminated, result.truncated, result.info
                )
            else:
                episode.end(_failure(result), RuntimeError(result.error))
            touched.append(group)
        return touched

    def _start(self, groups: list[_Group]) -> None:
        self._live += groups
        self._group_of.update({eid: group for group in groups for eid in group.episodes})
        requests = [(eid, group.seed) for group in groups for eid in group.episodes]
        for result in self.envs.reset(requests):
            episode = self._episode(result.episode_id)
            self._count_env(result)
            if result.status == OK:
                episode.start(result.observation)
            else:
                episode.end(_failure(result), RuntimeError(result.error))

    def _send(self, params: SamplingParams) -> None:
        """The next turn of every live episode waiting for one."""
        in_flight = {eid for _, eid in self._requests.values()}
        by_worker: dict[int, list[GenerateRequest]] = collections.defaultdict(list)
        for group in self._live:
            for eid, episode in group.episodes.items():
                if eid in in_flight or eid in self._stepping or episode.done:
                    continue
                context, room = episode.next_request()
                request_id = f"{eid}t{len(episode.turns)}"
                by_worker[group.worker].append(GenerateRequest(request_id, context, _within(params, room)))
                self._requests[request_id] = (group, eid)
        for worker, requests in by_worker.items():
            self.backend.submit(worker, requests)

    def _settle(
        self,
        groups: Any,
        complete: list[_Group],
        group_size: int,
        replace: Callable[[], _Group] | None,
    ) -> None:
        """Note the episodes of ``groups`` that ended; close the groups that completed or can no longer
        complete (drawing replacements)."""
        for group in list(groups):
            if group.closed:
                continue
            for eid, episode in group.episodes.items():
                if episode.done and eid not in group.ended and not episode.failed:
                    group.ended.append(eid)
            failed = sum(episode.failed for episode in group.episodes.values())
            if len(group.ended) >= group_size:
                self._close(group)
                complete.append(group)
            elif len(group.episodes) - failed < group_size:
                self._close(group)
                if replace is None:  # evaluation keeps the failed episode
                    continue
                self._counts["dropped_groups"] += 1
                if self._counts["dropped_groups"] > self.spec.max_dropped_groups:
                    errors = [e.error for e in group.episodes.values() if e.error]
                    raise RuntimeError(
                        f"{self._counts['dropped_groups']} episode groups were dropped in one step because "
                        f"their environment failed; the last error: {errors[-1] if errors else 'unknown'}"
                    )
                fresh = replace()
                self._start([fresh])
                self._settle([fresh], complete, group_size, replace)

    def _close(self, group: _Group) -> None:
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
        unfinished = [episode for episode in group.episodes.values() if not episode.done]
        for episode in unfinished:
            episode.end(StopReason.ABORTED)
        self._counts["aborted_episodes"] += len(unfinished)
        self.envs.close(list(group.episodes))
        for eid in group.episodes:
            self._group_of.pop(eid, None)
            self._stepping.pop(eid, None)

    def _episode(self, episode_id: str) -> Episode:
        return self._group_of[episode_id].episodes[episode_id]

    def _count_env(self, result: EnvResult) -> None:
        self._counts["env_calls"] += 1
        self._counts["env_retried"] += result.retried
        if result.status != OK:
            self._counts["env_errors" if result.status == ERROR else "env_timeouts"] += 1

    # ----- the batch -------------------------------------------------------------------------------------

    def _assemble(self, episodes: list[Episode], group_index: list[int]) -> Batch:
        """One row per episode: the prompt left-padded, the response (turns and observations)
        right-padded, the loss mask on the sampled tokens, the score its return (after the stop
        policy)."""
        policy = self.spec.stop_policy
        prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], self.pad_id)
        response_ids, response_mask = right_pad(
            [e.response_ids or [self.pad_id] for e in episodes], self.pad_id
        )
        width = response_ids.shape[1]
        trained = torch.zeros(len(episodes), width, dtype=response_mask.dtype)
        logprobs = torch.zeros(len(episodes), width)
        scores = []
        for row, episode in enumerate(episodes):
            rule = policy.get(episode.stop_reason.value, "train")
            n = len(episode.response_ids)
            if rule != "mask":
                trained[row, :n] = torch.tensor(episode.loss_mask, dtype=trained.dtype)
            logprobs[row, :n] = torch.tensor(episode.logprobs)
            scores.append(0.0 if rule == "zero" else episode.episode_return)
            if n == 0:
                response_mask[row] = 0
        return Batch(
            tensors={
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "response_ids": response_ids,
                "response_mask": response_mask,
                "loss_mask": trained,
                "rollout_logprobs": logprobs,
                "group_index": torch.tensor(group_index),
                "scores": torch.tensor(scores, dtype=torch.float32),
            },
            non_tensors={
                "seed": [e.seed for e in episodes],
                "stop_reason": [e.stop_reason.value for e in episodes],
                "token_rewards": [None] * len(episodes),
            },
        )

    def _metrics(self, episodes: list[Episode]) -> dict[str, float]:
        metrics = episode_metrics(episodes, "episode")
        counts, calls = self._counts, max(self._counts["env_calls"], 1)
        metrics.update(
            {
                "env/error_frac": counts["env_errors"] / calls,
                "env/timeout_frac": counts["env_timeouts"] / calls,
                "env/retried_frac": counts["env_retried"] / calls,
                # From sending an episode's step to taking its result: the env's time plus the call's.
                "env/step_s": sum(self._env_seconds) / max(len(self._env_seconds), 1),
                "rollout/dropped_groups": float(counts["dropped_groups"]),
                "rollout/aborted_episodes": float(counts["aborted_episodes"]),
            }
        )
        return metrics


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """Success rate, return, turns, invalid-action rate, tokens, stop reasons and the action histogram
    of ``episodes`` (the histogram catches a policy that repeats one action)."""
    n = max(len(episodes), 1)
    turns = [turn for episode in episodes for turn in episode.turns]
    metrics = {
        f"{prefix}/success": sum(e.success for e in episodes) / n,
        f"{prefix}/return": sum(e.episode_return for e in episodes) / n,
        f"{prefix}/turns": len(turns) / n,
        # A turn the env did not act on (no stop id within the turn's budget) is no valid action either.
        f"{prefix}/invalid_action_frac": sum(_label(t) in ("invalid", "unfinished") for t in turns)
        / max(len(turns), 1),
        f"{prefix}/response_tokens": sum(len(e.response_ids) for e in episodes) / n,
    }
    reasons = collections.Counter(e.stop_reason.value for e in episodes if e.stop_reason is not None)
    training = prefix == "episode"
    for reason in StopReason:  # every reason in training; in evaluation the ones that occurred
        if training or reasons[reason.value]:
            metrics[f"{prefix}/stop/{reason.value}"] = reasons[reason.value] / n
    if training:  # the histogram of training turns
        actions = collections.Counter(_label(turn) for turn in turns)
        common = dict(actions.most_common(MAX_ACTION_KEYS))
        for action, count in common.items():
            metrics[f"actions/{action}"] = count / max(len(turns), 1)
        other = sum(actions.values()) - sum(common.values())
        if other:
            metrics["actions/other"] = other / len(turns)
    return metrics


def _label(turn: Turn) -> str:
    """A turn in the action histogram: its text, ``invalid`` (the env refused it) or ``unfinished`` (cut
    by the turn's token budget: never acted on)."""
    if not turn.acted:
        return "unfinished"
    return turn.text.strip() if turn.action_is_valid else "invalid"


def _within(params: SamplingParams, room: int) -> SamplingParams:
    """``params`` for a turn with ``room`` tokens left (fewer than a turn's budget near the context end)."""
    return params if room >= params.max_new_tokens else dataclasses.replace(params, max_new_tokens=room)


def _failure(result: EnvResult) -> StopReason:
    return StopReason.ENV_ERROR if result.status == ERROR else StopReason.ENV_TIMEOUT
