"""RLVR: reinforcement learning with verifiable rewards. The single controller's loop reads like the paper:
generate -> reward -> reference/old logprobs -> advantages -> train -> sync weights -> log -> evaluate.

The step, the roles it shares with every policy-training pipeline, weight sync and recovery are in
``roll.pipelines.policy``; this file is what RLVR adds: prompts, rewards by domain, the SFT warm start on
reference answers, the sample scheduler and the held-out evaluation."""

from __future__ import annotations

import dataclasses
import functools

import torch

from roll.config.rlvr import DomainConfig, RLVRConfig, run_domains
from roll.data.batch import Batch
from roll.data.dataset import PromptIterator
from roll.data.domains import DEFAULT_DOMAIN
from roll.data.images import IMAGES
from roll.data.mixing import DomainMixer
from roll.pipelines.common import evaluate
from roll.pipelines.domains import mix_domain_evals, reward_metrics, score_held_out
from roll.pipelines.policy import PolicyPipeline
from roll.pipelines.preflight import RunInputs
from roll.pipelines.roles import Role
from roll.rewards.scoring import DomainRewards, scored_in_controller
from roll.rewards.spec import domain_specs
from roll.rollout.backend import RewardDispatch, RolloutBackend, domain_ranks
from roll.rollout.scheduler import RolloutScheduler
from roll.workers.reward import RewardWorker


class RLVRPipeline(PolicyPipeline):
    """RL on prompts scored by verifiable rewards (``RLVRConfig``)."""

    config: RLVRConfig
    scheduler_roles = frozenset({"rollout", "reward"})

    def take_inputs(self, inputs: RunInputs) -> None:
        self.train_prompts, self.eval_prompts = inputs.train, inputs.eval

    def warm_start(self, inputs: RunInputs) -> str:
        """SFT on the training rows' reference answers; its model starts RL."""
        cfg = self.config
        return self.run_sft(
            inputs,
            cfg.sft_warm_start,
            data=cfg.data,
            reward=cfg.eval_reward or cfg.reward,
            eval=dataclasses.replace(cfg.eval, every_steps=0),
        )

    def before_start(self) -> None:
        self.prompt_order = self._prompt_order()

    def _prompt_order(self) -> PromptIterator | DomainMixer:
        """The training prompts' order: with ``domains``, each batch holds every domain's share."""
        cfg = self.config
        if not cfg.domains:
            return PromptIterator(self.train_prompts.rows, cfg.rollout.rollout_batch_size, seed=cfg.seed)
        sizes = {name: len(part) for name, part in self.train_prompts.by_domain().items()}
        ratios = {name: domain.ratio for name, domain in cfg.domains.items()}
        return DomainMixer(sizes, ratios, cfg.rollout.rollout_batch_size, seed=cfg.seed)

    def extra_roles(self) -> dict[str, Role]:
        """Reward workers for the domains the controller does not score (rewards cheaper than a Ray
        call are scored in the controller)."""
        if not self.reward_ranks:
            return {}
        rewards = {name: self.domain_rewards[name] for name in self.reward_ranks}
        size = sum(len(ranks) for ranks in self.reward_ranks.values())
        return {"reward": Role("reward", RewardWorker, size, rewards, replaceable=True, loads_model=False)}

    reward = property(lambda self: self.role_set.get("reward"))

    @property
    def domains(self) -> dict[str, DomainConfig]:
        return run_domains(self.config)

    @functools.cached_property
    def domain_rewards(self) -> dict[str, DomainRewards]:
        return {name: DomainRewards(*domain_specs(domain)) for name, domain in self.domains.items()}

    @functools.cached_property
    def reward_ranks(self) -> dict[str, list[int]]:
        """The ranks of the reward cluster of each domain scored on reward workers."""
        sizes = {name: domain.reward_world_size for name, domain in self.domains.items()}
        return domain_ranks({name: size for name, size in sizes.items() if name not in self.inline_rewards})

    @functools.cached_property
    def inline_rewards(self) -> dict[str, DomainRewards]:
        """The domains the controller scores itself (``scored_in_controller``)."""
        return {name: r for name, r in self.domain_rewards.items() if scored_in_controller(r)}

    def reward_dispatch(self) -> RewardDispatch:
        pad_id = self.tokenizer.pad_token_id
        return RewardDispatch(self.reward, pad_id, self.reward_ranks, self.inline_rewards)

    def make_scheduler(self, backend: RolloutBackend, id_prefix: str) -> RolloutScheduler:
        plan = self.plan
        return RolloutScheduler(
            backend,
            self.train_prompts,
            self.prompt_order,
            plan.scheduler,
            plan.sampling,
            self.tokenizer,
            id_prefix=id_prefix,
        )

    def step_metrics(self, batch: Batch, scores: torch.Tensor) -> dict[str, float]:
        truncated = sum(r == "length" for r in batch["finish_reason"]) / len(batch)
        domains = reward_metrics(scores, batch["domain"], batch["reward_info"], bool(self.config.domains))
        return {"response/truncated_frac": truncated, **domains}

    def evaluate(self) -> dict[str, float]:
        """Greedy answers to the held-out prompts, scored with each domain's evaluation reward. With
        ``domains``: ``eval/<domain>/score`` for each domain with held-out rows (``eval.max_prompts``
        applies per domain), and ``eval/score`` their mean weighted by the domains' ratios."""
        assert self.eval_prompts is not None
        with self.role_set.on_device(self.generator_role):
            rewards = self.reward_dispatch()
            per_domain = {}
            for name, prompts in self.eval_prompts.by_domain().items():
                per_domain[name] = evaluate(
                    prompts,
                    generate=lambda batch, params: self.generator.generate(
                        batch.select_keys([key for key in GENERATE_FIELDS if key in batch]), params
                    ),
                    score=lambda batch, name=name: score_held_out(rewards, batch, name),
                    params=self.plan.eval_sampling,
                    batch_size=self.config.eval.batch_size,
                    pad_id=self.tokenizer.pad_token_id,
                    max_prompts=self.config.eval.max_prompts,
                    divisor=self.generator.world_size,
                )
        if not self.config.domains:
            return per_domain[DEFAULT_DOMAIN]
        return mix_domain_evals(per_domain, {name: d.ratio for name, d in self.domains.items()})


# Each worker call carries only the fields its worker reads: pickling the whole batch (texts, dataset
# rows, every tensor) to each rank costs time that grows with the batch and buys nothing.
GENERATE_FIELDS = ("prompt_ids", "prompt_mask", IMAGES)  # images: a vision-language model's prompts
