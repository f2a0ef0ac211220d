"""Per-domain bookkeeping of a multi-domain RLVR run: reward metrics per domain, held-out scoring on
each domain's reward workers, and the mix of the domains' held-out scores."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roll.data.batch import Batch
from roll.rewards.scoring import response_token_ids
from roll.rollout.backend import RewardDispatch, ScoreJob


def reward_metrics(
    scores: torch.Tensor, domains: Sequence[str], infos: Sequence[dict[str, float]], per_domain: bool
) -> dict[str, float]:
    """The rewards' counters averaged over the batch (``reward/<counter>``: e.g. the share of responses
    whose check timed out) and, with ``per_domain``, for each domain: ``reward/<domain>/mean``, its
    counters (``reward/<domain>/<counter>``) and its share of the batch (``rollout/<domain>/frac``).

    Args:
        scores: [B] the responses' scores.
        domains: [B] each response's domain.
        infos: [B] each response's counters (``RewardOutput.info``); a missing counter counts as 0.
    """
    metrics = _counter_means("reward/", range(len(infos)), infos)
    if not per_domain:
        return metrics
    for name in dict.fromkeys(domains):
        rows = [i for i, d in enumerate(domains) if d == name]
        metrics[f"reward/{name}/mean"] = scores[rows].mean().item()
        metrics[f"rollout/{name}/frac"] = len(rows) / len(domains)
        metrics.update(_counter_means(f"reward/{name}/", rows, infos))
    return metrics


def _counter_means(prefix: str, rows: Sequence[int], infos: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(key for i in rows for key in infos[i])
    return {f"{prefix}{key}": sum(infos[i].get(key, 0.0) for i in rows) / len(rows) for key in keys}


def score_held_out(rewards: RewardDispatch, batch: Batch, domain: str) -> torch.Tensor:
    """[B] scores of a generated held-out batch of one domain, by that domain's reward workers with its
    evaluation reward."""
    jobs = [
        ScoreJob(f"eval-{i}", prompt, response, sample, ids or [], domain)
        for i, (prompt, response, sample, ids) in enumerate(
            zip(batch["prompt_text"], batch["response_text"], batch["sample"], response_token_ids(batch))
        )
    ]
    return torch.tensor([s.score for s in rewards.score(jobs, evaluation=True)], dtype=torch.float32)


def mix_domain_evals(per_domain: dict[str, dict[str, float]], ratios: dict[str, float]) -> dict[str, float]:
    """``eval/<domain>/<metric>`` for each evaluated domain, and the mix: ``eval/score`` and
    ``eval/response_length`` weighted by the domains' ratios, ``eval/time_s`` summed."""
    metrics: dict[str, float] = {}
    for name, result in per_domain.items():
        metrics.update({key.replace("eval/", f"eval/{name}/", 1): value for key, value in result.items()})
    weight = sum(ratios[name] for name in per_domain)
    for key in ("eval/score", "eval/response_length"):
        metrics[key] = sum(ratios[name] * result[key] for name, result in per_domain.items()) / weight
    metrics["eval/time_s"] = sum(result["eval/time_s"] for result in per_domain.values())
    return metrics
