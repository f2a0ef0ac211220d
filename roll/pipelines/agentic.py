"""Agentic RL: the policy plays multi-turn episodes in an environment and learns from how they end.

    (optional) imitate a scripted expert's episodes, in exactly the token layout RL samples
    each step: play groups of episodes per training seed (generate -> env step -> generate)
             -> trajectory-wise: one sample per episode, its return as the score
                step-wise: one sample per turn, credited per turn (GiGPO, step_reinforce)
             -> the RL step (GRPO, REINFORCE, PPO; GiGPO)
    evaluate: one greedy and one sampled episode per held-out seed

The step, the roles (actor, critic, reference, rollout), weight sync and recovery are the shared
skeleton's (``roll.pipelines.policy``); this file adds the environment workers, the episode scheduler
(``roll.rollout.episodes``), the expert warm start and the held-out episodes.
"""

from __future__ import annotations

import dataclasses

from roll.config.agentic import AgenticConfig
from roll.config.common import EvalConfig
from roll.config.sft import SFTTrainConfig
from roll.data.chat_turns import ChatTurns
from roll.data.prompts import PromptSet
from roll.envs.agents import make_agent
from roll.envs.base import make_env
from roll.envs.seeds import SeedOrder, held_out_seeds, training_seeds
from roll.models.loading import turn_stop_ids
from roll.pipelines.policy import PolicyPipeline
from roll.pipelines.preflight import RunInputs
from roll.pipelines.roles import Role
from roll.pipelines.worker_specs import mini_batches_per_epoch
from roll.rollout.backend import RolloutBackend
from roll.rollout.env_clients import RayEnvs
from roll.rollout.episode import EpisodeBudget, demonstration
from roll.rollout.episodes import EpisodeScheduler, EpisodeSpec, episode_metrics
from roll.utils.signals import set_activity
from roll.workers.environment import EnvSpec, EnvWorker


class AgenticPipeline(PolicyPipeline):
    """RL on episodes of ``config.env`` (``AgenticConfig``), trajectory-wise or step-wise."""

    config: AgenticConfig
    scheduler_roles = frozenset({"rollout", "environment"})
    eval_prompts = None
    evaluates = True  # on held-out seeds

    def take_inputs(self, inputs: RunInputs) -> None:
        cfg = self.config
        self.seed_order = SeedOrder(make_env(cfg.env.name, cfg.env.options), cfg.eval.seeds)
        self.vision = inputs.vision  # a vision-language policy's image processing (pictures in observations)

    @property
    def rows_vary(self) -> bool:  # step-wise: one row per turn
        return self.config.env.sample_layout == "step_wise"

    @property
    def history_turns(self) -> int | None:
        """The turns of history a step-wise turn sees (None: trajectory-wise, the whole episode)."""
        env = self.config.env
        return env.history_turns if env.sample_layout == "step_wise" else None

    @property
    def budget_per_episode(self) -> EpisodeBudget:
        env = self.config.env
        return EpisodeBudget(env.max_turns, self.config.rollout.max_new_tokens, env.max_context_tokens)

    def chat(self) -> ChatTurns:
        """Turn-by-turn ids of the policy's chat template; a turn ends at any of the engine's stop ids."""
        stop_ids = turn_stop_ids(self.tokenizer, self.model_path, self.config.rollout.stop_token_ids)
        return ChatTurns(self.tokenizer, stop_ids, self.config.env.system_prompt, self.vision)

    def warm_start(self, inputs: RunInputs) -> str:
        """SFT on the expert's episodes (training seeds only); its model starts RL."""
        warm = self.config.sft_warm_start
        set_activity(f"playing {warm.episodes} episodes of the {warm.expert} agent")
        train = SFTTrainConfig(**{f.name: getattr(warm, f.name) for f in dataclasses.fields(SFTTrainConfig)})
        played = expert_rows(self.config, self.chat(), self.budget_per_episode, self.history_turns)
        rows = RunInputs(self.tokenizer, played, None)
        return self.run_sft(rows, train, eval=EvalConfig(every_steps=0))

    def extra_roles(self) -> dict[str, Role]:
        env = self.config.env
        spec = EnvSpec(env.name, env.options, env.step_timeout_s)
        worker = Role("environment", EnvWorker, env.world_size, spec, replaceable=True, loads_model=False)
        return {"environment": worker}

    def make_scheduler(self, backend: RolloutBackend, id_prefix: str) -> EpisodeScheduler:
        cfg = self.config
        spec = EpisodeSpec(
            groups_per_step=cfg.rollout.rollout_batch_size,
            group_size=cfg.rollout.num_return_sequences,
            budget=self.budget_per_episode,
            redundancy=cfg.env.group_size_redundancy,
            stop_policy=cfg.env.stop_policy(),
            history_turns=self.history_turns,
            max_tool_failure_frac=cfg.env.max_tool_failure_frac,
            async_generation_ratio=cfg.rollout.async_generation_ratio,
            # Step-wise batches are padded to this many rows: the actor's ranks, then its mini-batches.
            divisor=cfg.actor.world_size * mini_batches_per_epoch(cfg.actor, episodes_per_step(cfg)),
        )
        envs = RayEnvs(self.role_set.get("environment"))
        pad_id = self.tokenizer.pad_token_id
        return EpisodeScheduler(
            backend, envs, self.chat(), spec, self.plan.sampling, self.seed_order, pad_id, id_prefix
        )

    def evaluate(self) -> dict[str, float]:
        """One greedy and one sampled episode on each held-out seed: ``eval/greedy/*``,
        ``eval/sampled/*`` (success, return, turns, invalid actions, stop reasons); ``eval/score`` is the
        success rate ``eval.score`` names."""
        with self.role_set.on_device(self.generator_role):
            seeds = held_out_seeds(self.config.eval.seeds)
            metrics: dict[str, float] = {}
            for mode, params in (("greedy", self.plan.sampling.as_greedy()), ("sampled", self.plan.sampling)):
                metrics.update(episode_metrics(self.scheduler.play(seeds, params), f"eval/{mode}"))
        metrics["eval/score"] = metrics[f"eval/{self.config.eval.score}/success"]
        return metrics


def expert_rows(
    cfg: AgenticConfig, chat: ChatTurns, budget: EpisodeBudget, history_turns: int | None = None
) -> PromptSet:
    """``sft_warm_start.episodes`` episodes of the expert on the training seeds, as token rows in the
    layout RL samples (``roll.rollout.episode.demonstration``): one row per episode, or step-wise one
    per turn (the turn's context and its ids)."""
    warm = cfg.sft_warm_start
    env = make_env(cfg.env.name, cfg.env.options)
    agent = make_agent(warm.expert, warm.expert_options, seed=cfg.seed)
    seeds = training_seeds(env, cfg.eval.seeds)
    played = [
        demonstration(env, agent, next(seeds), chat, budget, history_turns) for _ in range(warm.episodes)
    ]
    if history_turns is None:
        rows = [{"response_ids": e.response_ids, "loss_mask": e.loss_mask, "seed": e.seed} for e in played]
        pictures = [e.images() or None for e in played]
        return _rows(rows, [e.prompt_ids for e in played], pictures, chat)
    rows, prompts, pictures = [], [], []
    for episode in played:
        for k, turn in enumerate(episode.turns):
            ids = episode.response_ids[turn.start : turn.end]
            rows.append({"response_ids": ids, "loss_mask": [1] * len(ids), "seed": episode.seed})
            prompts.append(episode.turn_context(k))
            pictures.append(episode.turn_images(k) or None)
    return _rows(rows, prompts, pictures, chat)


def _rows(rows: list[dict], prompts: list[list[int]], pictures: list, chat: ChatTurns) -> PromptSet:
    """Demonstration rows as prompts, with their pictures where the env showed any."""
    shown = any(p is not None for p in pictures)
    return PromptSet(rows, [""] * len(rows), prompts, images=pictures if shown else None, vision=chat.vision)


def episodes_per_step(cfg: AgenticConfig) -> int:
    """Episodes trained on per step (``mini_batch_size`` counts these, also in step-wise runs)."""
    return cfg.rollout.rollout_batch_size * cfg.rollout.num_return_sequences
