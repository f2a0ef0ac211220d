"""Reward worker: scores responses with each domain's reward (``roll.rewards.spec``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register
from roll.rewards.spec import RewardSpec


@dataclass(frozen=True)
class DomainRewards:
    """How one domain's responses are scored in training and in evaluation."""

    train: RewardSpec
    eval: RewardSpec


def response_token_ids(batch: Batch) -> list[list[int]] | list[None]:
    """Per row, the response's token ids without padding (``response_ids[i][response_mask[i]]``), or
    ``None`` per row when the batch carries no ``response_ids``/``response_mask``."""
    if "response_ids" not in batch or "response_mask" not in batch:
        return [None] * len(batch)
    ids, mask = batch["response_ids"], batch["response_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


class RewardWorker(Worker):
    """``config``: each domain's ``DomainRewards`` by domain name, or a single reward's registry name
    (then every row is scored by it, in training and in evaluation)."""

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: Batch, function: str | None = None, evaluation: bool = False) -> Batch:
        """Score rows with ``prompt_text``, ``response_text`` and the dataset row ``sample`` (plus, when
        present, ``response_ids``/``response_mask`` [B, T], handed to rewards that declare
        ``response_ids``, and ``domain``, the row's domain), with the domain's training reward, its
        evaluation reward (``evaluation``) or, when given, the registered ``function``.

        Returns:
            A Batch with ``scores`` [B] float32 and the non-tensors ``token_rewards`` (per row the
            reward's per-token rewards, a list of floats, one per response token, or None) and
            ``reward_info`` (per row the rewards' numeric counters, e.g. ``{"timeout": 1.0}``).

        Raises:
            KeyError: a row's domain is not one this worker scores.
        """
        from roll.rewards.spec import score_all

        domains = self.domain_rewards()
        names = batch["domain"] if "domain" in batch else [next(iter(domains))] * len(batch)
        unknown = [name for name in names if name not in domains and function is None]
        if unknown:
            raise KeyError(
                f"no reward is configured for domain '{unknown[0]}' (domains: {', '.join(domains)})"
            )
        ids = response_token_ids(batch)
        outputs: list = [None] * len(batch)
        # Rows of one domain are scored together: a batched reward (a judge model) sees them at once.
        for name in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == name]
            if function is not None:
                spec = RewardSpec.single(function)
            else:
                spec = domains[name].eval if evaluation else domains[name].train
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

    def domain_rewards(self) -> dict[str, DomainRewards]:
        if isinstance(self.config, str):
            from roll.data.domains import DEFAULT_DOMAIN

            single = RewardSpec.single(self.config)
            return {DEFAULT_DOMAIN: DomainRewards(single, single)}
        return self.config
