"""Agent runs as training rows and metrics: one run (``AgentRun``: its session and how it ended), a batch
of runs (``run_batch``: a row per trained branch of each run, its sampled tokens trained), their metrics
(``run_metrics``, ``scheduler_metrics``), and the warm start's demonstrations (``demonstrations``). The
scheduler that plays them is ``roll.rollout.agent_scheduler``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from roll.data.batch import Batch
from roll.data.padding import left_pad, right_pad
from roll.data.prompts import PromptSet
from roll.rollout.agent_runs import AgentOutcome
from roll.rollout.episode_batch import pad_evenly
from roll.rollout.sessions import Branch, Session

if TYPE_CHECKING:
    from roll.rollout.agent_scheduler import AgentScheduler

__all__ = [
    "BUDGETS",
    "DONE",
    "FAILURES",
    "AgentRun",
    "demonstrations",
    "run_batch",
    "run_metrics",
    "scheduler_metrics",
]

FAILURES = ("agent_error", "agent_timeout", "no_calls", "no_reward")
# The stop reasons of a run that ran out of a budget: its calls, its context, or a reply's tokens (its
# agent failed on a reply cut at rollout.max_new_tokens, as the Agents SDK does on an incomplete one).
BUDGETS = ("max_turns", "context_limit", "turn_truncated")
DONE = "agent_done"  # the stop reason of a run whose agent ended it


@dataclass(eq=False)
class AgentRun:
    """One run of the agent: its session, and once it ended, its ``outcome``; ``stop_reason``: the budget
    it ran out of (``BUDGETS``), None while it has not."""

    run_id: str
    session: Session
    outcome: AgentOutcome | None = None
    future: Any = None  # the agent's, while it plays
    calls: int = 0  # calls to the policy it made
    stop_reason: str | None = None
    calls_past_budget: int = 0
    cut: str | None = None  # its latest reply stopped at its length limit: the budget that cut it

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def failed(self) -> bool:
        return self.outcome is not None and self.outcome.failure is not None

    @property
    def error(self) -> str | None:
        return self.outcome.error if self.outcome is not None else None

    @property
    def versions(self) -> list[int]:
        """The weights version of every token of its branches."""
        return [v for branch in self.session.branches for v in branch.weight_versions]

    def sample(self) -> Branch | None:
        """The run's longest branch: the one with the most sampled tokens (the latest of equals)."""
        best = None
        for branch in self.session.branches:
            if any(branch.trained) and (best is None or sum(branch.trained) >= sum(best.trained)):
                best = branch
        return best

    def trained_branches(self, every: bool) -> list[Branch]:
        """The branches that train: ``every`` branch with sampled tokens (``agent.train_branches: all``),
        in the order they opened, or the longest alone."""
        if every:
            return [branch for branch in self.session.branches if any(branch.trained)]
        longest = self.sample()
        return [] if longest is None else [longest]


def run_metrics(runs: list[AgentRun], prefix: str, every_branch: bool = False) -> dict[str, float]:
    """Return, success (reward > 0), calls, branches, forks, trained and masked tokens of ``runs`` (failed
    runs count in ``failed_frac`` and as no success); ``untrained_branches``: a run's branches with sampled
    tokens that do not train (none with ``every_branch``)."""
    n = max(len(runs), 1)
    rewards = [run.outcome.reward if run.outcome and run.outcome.reward is not None else 0.0 for run in runs]
    stats = [run.session.stats() for run in runs]
    trains = [run.trained_branches(every_branch) for run in runs]
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
            sum(1 for b in run.session.branches if any(b.trained) and all(b is not t for t in trained))
            for run, trained in zip(runs, trains)
        )
        / n,
    }


def run_batch(
    runs: list[AgentRun],
    group_index: list[int],
    seeds: list[int],
    pad_id: int,
    stop_policy: Mapping[str, str] | None = None,
    every_branch: bool = False,
    divisor: int = 1,
) -> Batch:
    """A row per trained branch of each run (``AgentRun.trained_branches``): prompt left-padded, response
    right-padded, the loss on the sampled tokens, the score the run's reward; a run that ran out of a
    budget as ``stop_policy`` says (``mask``: no token trained, ``zero``: scored 0). With
    ``every_branch`` the rows carry ``episode_index`` (the run's place in ``runs``), so the estimators
    count each run once in its group, and the batch is padded to a multiple of ``divisor`` rows
    (``roll.rollout.episode_batch.pad_evenly``)."""
    prompts, responses, trained, logprobs, scores, owners = [], [], [], [], [], []
    for index, run in enumerate(runs):
        rule = (stop_policy or {}).get(run.stop_reason or "env_done", "train")  # its agent ended it
        for branch in run.trained_branches(every_branch):
            first = branch.trained.index(True)
            prompts.append(branch.token_ids[:first])
            responses.append(branch.token_ids[first:])
            trained.append([flag and rule != "mask" for flag in branch.trained[first:]])
            logprobs.append(branch.logprobs[first:])
            scores.append(0.0 if rule == "zero" else run.outcome.reward)
            owners.append(index)
    assert len(set(owners)) == len(runs)  # a run with no sampled token failed (no_calls)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    response_ids, response_mask = right_pad(responses, pad_id)
    loss_mask = torch.zeros_like(response_mask)
    rollout_logprobs = torch.zeros(response_ids.shape)
    for row, (flags, values) in enumerate(zip(trained, logprobs)):
        loss_mask[row, : len(flags)] = torch.tensor(flags, dtype=loss_mask.dtype)
        rollout_logprobs[row, : len(values)] = torch.tensor(values)
    batch = Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rollout_logprobs": rollout_logprobs,
            "group_index": torch.tensor([group_index[i] for i in owners]),
            "scores": torch.tensor(scores, dtype=torch.float32),
        },
        non_tensors={
            "seed": [seeds[group_index[i]] for i in owners],
            "stop_reason": [runs[i].stop_reason or DONE for i in owners],
            "token_rewards": [None] * len(owners),
            "episode_id": [runs[i].run_id for i in owners],
        },
    )
    if not every_branch:
        return batch
    batch["episode_index"] = torch.tensor(owners)
    return pad_evenly(batch, divisor)


def scheduler_metrics(
    runs: list[AgentRun], counts: Mapping[str, int], weights_version: int
) -> dict[str, float]:
    """The failure rates of a step's runs (``counts``: runs ended, by how), its dropped groups and aborted
    runs, and the staleness of ``runs`` (their oldest sampled token's weights) at ``weights_version``."""
    counted = max(counts.get("runs", 0), 1)
    oldest = [
        min((v for b in run.session.branches for v in b.weight_versions if v >= 0), default=weights_version)
        for run in runs
    ]
    staleness = [weights_version - version for version in oldest]
    metrics = {f"agent/{failure}_frac": counts.get(failure, 0) / counted for failure in FAILURES}
    metrics.update(
        {
            "rollout/dropped_groups": float(counts.get("dropped_groups", 0)),
            "rollout/aborted_runs": float(counts.get("aborted_runs", 0)),
            "rollout/stale_groups": float(counts.get("stale_groups", 0)),
            "rollout/staleness_mean": sum(staleness) / max(len(staleness), 1),
            "rollout/staleness_max": float(max(staleness, default=0)),
        }
    )
    return metrics


def demonstrations(scheduler: AgentScheduler, count: int) -> PromptSet:
    """``count`` runs played by ``scheduler`` (over an ``ExpertBackend``: the warm start's), as SFT rows in
    the layout RL trains on: each run's prompt ids, and its response ids with the loss on what was sampled."""
    prompts: list[list[int]] = []
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        batch, _ = scheduler.next_batch(0)
        for row in range(len(batch)):
            if "padding" in batch and bool(batch["padding"][row]):
                continue
            n = int(batch["response_mask"][row].sum())
            prompts.append(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist())
            rows.append(
                {
                    "response_ids": batch["response_ids"][row, :n].tolist(),
                    "loss_mask": batch["loss_mask"][row, :n].tolist(),
                }
            )
    return PromptSet(rows[:count], [""] * count, prompts[:count])
