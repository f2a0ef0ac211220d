"""Agent runs as training rows and metrics: one run (``AgentRun``: its session and how it ended), a batch
of runs (``run_batch``: one row per run, its sampled tokens trained), their metrics (``run_metrics``), and
the warm start's demonstrations (``demonstrations``). The scheduler that plays them is
``roll.rollout.agent_scheduler``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from roll.data.batch import Batch
from roll.data.padding import left_pad, right_pad
from roll.data.prompts import PromptSet
from roll.rollout.agent_runs import AgentOutcome
from roll.rollout.sessions import Branch, Session

if TYPE_CHECKING:
    from roll.rollout.agent_scheduler import AgentScheduler

__all__ = ["BUDGETS", "DONE", "FAILURES", "AgentRun", "demonstrations", "run_batch", "run_metrics"]

FAILURES = ("agent_error", "agent_timeout", "no_calls", "no_reward")
BUDGETS = ("max_turns", "context_limit")  # the stop reasons of a run that ran out of a budget
DONE = "agent_done"  # the stop reason of a run whose agent ended it


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
