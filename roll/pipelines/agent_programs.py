"""Agentic RL on a user's agent program (the ``agent:`` section): the agent calls an OpenAI-compatible
endpoint, and what the policy sampled for it is what trains.

    serve the policy on the endpoint (in this process), its sessions recording token ids
    each step: run the agent on groups of tasks, each run in its own session
             -> a sample per run (its longest branch) or per branch (agent.train_branches: all),
                the run's reward as the score, each run once in its group's baseline
             -> the RL step (GRPO, REINFORCE, PPO)
    evaluate: one greedy and one sampled run per held-out task

Everything else (the roles, weight sync, checkpoints, recovery, asynchronous training) is the agentic
pipeline's; the agent scheduler (``roll.rollout.agent_scheduler``) takes the episode scheduler's place
and the endpoint the environment workers'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from roll.config.agentic import AgentConfig
from roll.config.common import EvalConfig
from roll.config.sft import SFTTrainConfig
from roll.envs.agents import make_agent
from roll.envs.seeds import SeedOrder, held_out_seeds
from roll.models.loading import turn_stop_ids
from roll.pipelines.agentic import AgenticPipeline, episodes_per_step
from roll.pipelines.preflight import RunInputs
from roll.pipelines.roles import Role
from roll.pipelines.worker_specs import mini_batches_per_epoch
from roll.rewards.base import score_response
from roll.rollout.agent_runs import AgentRunner, TaskList, load_entrypoint
from roll.rollout.agent_scheduler import (
    AgentScheduler,
    AgentSpec,
    SchedulerEngine,
    demonstrations,
    run_metrics,
)
from roll.rollout.backend import RolloutBackend
from roll.rollout.expert_backend import ExpertBackend
from roll.rollout.sessions import SessionStore
from roll.strategies.requests import SamplingParams
from roll.utils.signals import set_activity


class AgentProgramPipeline(AgenticPipeline):
    """RL on runs of ``agent.entrypoint`` over the tasks of ``agent.tasks``."""

    scheduler_roles = frozenset({"rollout"})
    server: Any = None
    runner: AgentRunner | None = None

    def take_inputs(self, inputs: RunInputs) -> None:
        agent = self.agent
        self.tasks = TaskList(agent.tasks, self.config.eval.seeds)
        self.seed_order = SeedOrder(self.tasks, self.config.eval.seeds)  # type: ignore[arg-type]
        self.entrypoint = load_entrypoint(agent.entrypoint)
        self.sessions = SessionStore()
        self.engine = SchedulerEngine()

    @property
    def agent(self) -> AgentConfig:
        assert self.config.agent is not None  # roll.pipelines.run_agentic picks this pipeline by it
        return self.config.agent

    def extra_roles(self) -> dict[str, Role]:
        return {}  # the agent runs in this process; the policy's calls go to the rollout workers

    def warm_start(self, inputs: RunInputs) -> str:
        """SFT on the agent program's runs against the scripted expert (training tasks only), recorded
        by the endpoint's sessions exactly as RL's runs are; its model starts RL."""
        cfg, warm = self.config, self.config.sft_warm_start
        set_activity(f"playing {warm.episodes} runs of the agent against the {warm.expert} expert")
        expert = make_agent(warm.expert, warm.expert_options, seed=cfg.seed)
        backend = ExpertBackend(expert, self.tokenizer, self.end_of_turn_ids[0])
        groups = min(64, warm.episodes)
        spec = dataclasses.replace(  # as many spare runs: one that hangs holds up nothing but itself
            self.agent_spec, groups_per_step=groups, group_size=1, async_generation_ratio=0
        )
        spec = dataclasses.replace(spec, spare_groups=groups)
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens)  # the expert does not sample
        scheduler = self._scheduler(backend, spec, params, SeedOrder(self.tasks, cfg.eval.seeds), "warm-")
        try:
            played = demonstrations(scheduler, warm.episodes)
        finally:
            scheduler.close()
        train = SFTTrainConfig(**{f.name: getattr(warm, f.name) for f in dataclasses.fields(SFTTrainConfig)})
        return self.run_sft(RunInputs(self.tokenizer, played, None), train, eval=EvalConfig(every_steps=0))

    @property
    def agent_spec(self) -> AgentSpec:
        cfg = self.config
        return AgentSpec(
            groups_per_step=cfg.rollout.rollout_batch_size,
            group_size=cfg.rollout.num_return_sequences,
            timeout_s=self.agent.timeout_s,
            max_calls=cfg.env.max_turns,
            max_context_tokens=cfg.env.max_context_tokens,
            stop_policy=cfg.env.stop_policy(),
            redundancy=cfg.env.group_size_redundancy,
            async_generation_ratio=cfg.rollout.async_generation_ratio,
            train_branches=self.agent.train_branches,
            spare_groups=self.agent.spare_groups,
            # Every branch a row: the batch is padded to the actor's ranks times its mini-batches.
            divisor=cfg.actor.world_size * mini_batches_per_epoch(cfg.actor, episodes_per_step(cfg)),
        )

    @property
    def rows_vary(self) -> bool:  # train_branches all: as many rows as the runs have branches
        return self.agent.train_branches == "all"

    def make_scheduler(self, backend: RolloutBackend, id_prefix: str) -> AgentScheduler:
        return self._scheduler(backend, self.agent_spec, self.plan.sampling, self.seed_order, id_prefix)

    def _scheduler(
        self, backend: RolloutBackend, spec: AgentSpec, params: SamplingParams, seeds: SeedOrder, prefix: str
    ) -> AgentScheduler:
        """A scheduler of ``spec``'s runs over ``backend``, behind the endpoint (started the first time)."""
        if self.server is None:
            self._serve()
        assert self.runner is not None
        scheduler = AgentScheduler(
            backend,
            self.runner,
            self.sessions,
            self.server.base_url,
            spec,
            params,
            self.tasks,
            seeds,
            self.tokenizer.pad_token_id,
            prefix,
            transcript_reward=self._transcript_reward(),
            progress_every_s=self.config.ray.progress_every_s,
        )
        self.engine.scheduler = scheduler
        return scheduler

    def _transcript_reward(self) -> Any:
        """``agent.reward`` as the scheduler's ``transcript_reward`` (None where unset): the prompt
        is the run's transcript up to its last reply (as rendered), the response that reply's text."""
        name = self.agent.reward
        if name is None:
            return None
        decode = self.tokenizer.decode

        def score(prompt_ids: list[int], reply_ids: list[int], task: dict[str, Any]) -> float:
            prompt, reply = decode(prompt_ids), decode(reply_ids, skip_special_tokens=True)
            return score_response(name, prompt, reply, task, reply_ids).score

        return score

    @property
    def end_of_turn_ids(self) -> list[int]:
        return turn_stop_ids(self.tokenizer, self.model_path, self.config.rollout.stop_token_ids)

    def _serve(self) -> None:
        """The endpoint, in a thread of this process, and the loop the agent runs on."""
        from roll.serving.app import Limits, build_app
        from roll.serving.server import ServerThread

        cfg = self.config
        # Every run of a step (and of the steps played ahead) and every held-out run may call at once.
        groups = cfg.rollout.rollout_batch_size * (1 + cfg.rollout.async_generation_ratio)
        runs = (groups + self.agent.spare_groups) * cfg.rollout.num_return_sequences + cfg.eval.seeds
        runs = min(runs, self.agent.concurrency or runs)  # the runs that play at once
        limits = Limits(
            max_tokens=cfg.rollout.max_new_tokens,
            max_model_len=None,  # each run's context is its scheduler's to bound (a budget, not an error)
            max_in_flight=max(256, 2 * runs),
            clamp_max_tokens=True,
        )
        app = build_app(self.engine, self.tokenizer, None, self.end_of_turn_ids, limits, self.sessions)
        self.server = ServerThread(app).start()
        self.runner = AgentRunner(self.entrypoint, concurrency=self.agent.concurrency)

    def evaluate(self) -> dict[str, float]:
        """One greedy and one sampled run on each held-out task: ``eval/greedy/*``, ``eval/sampled/*``
        (return, success: reward > 0, failed runs, calls, forks); ``eval/score`` is the success rate
        ``eval.score`` names."""
        with self.role_set.on_device(self.generator_role):
            seeds = held_out_seeds(self.config.eval.seeds)
            metrics: dict[str, float] = {}
            for mode, params in (("greedy", self.plan.sampling.as_greedy()), ("sampled", self.plan.sampling)):
                metrics.update(run_metrics(self.scheduler.play(seeds, params), f"eval/{mode}"))
        metrics["eval/score"] = metrics[f"eval/{self.config.eval.score}/success"]
        return metrics

    def shutdown(self) -> None:
        super().shutdown()
        if self.runner is not None:
            self.runner.close()
        if self.server is not None:
            self.server.stop()
