"""Scoring rows of a batch, each with its domain's reward: the reward workers' computation, and the
controller's for the domains it scores itself. Pure: no Ray, no workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roll.data.batch import Batch
from roll.rewards.base import REWARD_FUNCTIONS
from roll.rewards.spec import RewardSpec, score_all


@dataclass(frozen=True)
class DomainRewards:
    """How one domain's responses are scored in training and in evaluation."""

    train: RewardSpec
    eval: RewardSpec

    def spec(self, evaluation: bool) -> RewardSpec:
        return self.eval if evaluation else self.train


def response_token_ids(batch: Batch) -> list[list[int]] | list[None]:
    """Per row, the response's token ids without padding (``response_ids[i][response_mask[i]]``), or
    ``None`` per row when the batch carries no ``response_ids``/``response_mask``."""
    if "response_ids" not in batch or "response_mask" not in batch:
        return [None] * len(batch)
    ids, mask = batch["response_ids"], batch["response_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


def score_rows(
    domains: dict[str, DomainRewards], batch: Batch, function: str | None = None, evaluation: bool = False
) -> Batch:
    """Score rows with ``prompt_text``, ``response_text`` and the dataset row ``sample`` (plus, when
    present, ``response_ids``/``response_mask`` [B, T], handed to rewards that declare
    ``response_ids``, and ``domain``, the row's domain), with the domain's training reward, its
    evaluation reward (``evaluation``) or, when given, the registered ``function``. Reward workers
    call it, and the controller for the domains it scores itself (``scored_in_controller``).

    Returns:
        A Batch with ``scores`` [B] float32 and the non-tensors ``token_rewards`` (per row the
        reward's per-token rewards, a list of floats, one per response token, or None) and
        ``reward_info`` (per row the rewards' numeric counters, e.g. ``{"timeout": 1.0}``).

    Raises:
        KeyError: a row's domain is not one of ``domains``.
    """
    names = batch["domain"] if "domain" in batch else [next(iter(domains))] * len(batch)
    unknown = [name for name in names if name not in domains and function is None]
    if unknown:
        raise KeyError(f"no reward is configured for domain '{unknown[0]}' (domains: {', '.join(domains)})")
    ids = response_token_ids(batch)
    outputs: list = [None] * len(batch)
    # Rows of one domain are scored together: a batched reward (a judge model) sees them at once.
    for name in dict.fromkeys(names):
        rows = [i for i, n in enumerate(names) if n == name]
        spec = RewardSpec.single(function) if function is not None else domains[name].spec(evaluation)
        scored = score_all(
            spec,
            [batch["prompt_text"][i] for i in rows],
            [batch["response_text"][i] for i in rows],
            [batch["sample"][i] for i in rows],
            [ids[i] for i in rows],
        )
        for i, out in zip(rows, scored):
            outputs[i] = out
    return Batch(
        tensors={"scores": torch.tensor([out.score for out in outputs], dtype=torch.float32)},
        non_tensors={
            "token_rewards": [
                None if out.token_rewards is None else [float(r) for r in out.token_rewards]
                for out in outputs
            ],
            "reward_info": [dict(out.info) for out in outputs],
        },
    )


def scored_in_controller(rewards: DomainRewards) -> bool:
    """Whether every reward of the domain, in training and in evaluation, is registered ``inline``: a
    pure check that costs less than the Ray call to a reward worker (``exact_match``), so the controller
    scores it as each response finishes, and the domain has no reward workers."""
    names = [*rewards.train.names(), *rewards.eval.names()]
    return all(REWARD_FUNCTIONS.traits(name).get("inline", False) for name in names)
