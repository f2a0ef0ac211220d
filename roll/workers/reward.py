"""Reward worker: scores responses with each domain's reward (``roll.rewards.scoring``)."""

from __future__ import annotations

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register
from roll.rewards.scoring import DomainRewards, score_rows
from roll.rewards.spec import RewardSpec


class RewardWorker(Worker):
    """``config``: each domain's ``DomainRewards`` by domain name, or a single reward's registry name
    (then every row is scored by it, in training and in evaluation)."""

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: Batch, function: str | None = None, evaluation: bool = False) -> Batch:
        """``score_rows`` with this worker's domains."""
        return score_rows(self.domain_rewards(), batch, function, evaluation)

    def domain_rewards(self) -> dict[str, DomainRewards]:
        if isinstance(self.config, str):
            from roll.data.domains import DEFAULT_DOMAIN

            single = RewardSpec.single(self.config)
            return {DEFAULT_DOMAIN: DomainRewards(single, single)}
        return self.config
