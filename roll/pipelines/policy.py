"""The RL step of every pipeline that trains a policy on its own samples (RLVR, agentic). Its roles, their
devices and turns on shared devices are a ``RoleSet``'s (``roles.py``), lost workers a ``Supervisor``'s
(``supervisor.py``), the weights and their version a ``WeightPublisher``'s (``weight_publisher.py``).

A pipeline on it gives what differs: the inputs it reads (``take_inputs``), its warm start, the roles
beside actor, critic, rollout and reference (``extra_roles``), the scheduler that turns the rollout
workers' samples into training batches (``make_scheduler``), ``evaluate`` and its own step metrics. The
step itself reads like the algorithm:

    samples -> reference/old logprobs, values -> per-token rewards -> advantages -> critic, actor ->
    weights to the rollout workers
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Any

import torch

from roll.algorithms.functional import masked_mean
from roll.algorithms.kl import adaptive_kl_coef
from roll.config.devices import resolve_world_sizes
from roll.config.loader import ConfigError
from roll.config.rlvr import off_policy_note
from roll.data.batch import Batch
from roll.data.images import IMAGES
from roll.data.masks import loss_mask
from roll.distributed.cluster import Cluster, WorkerError
from roll.distributed.weight_sync import WeightSync, WeightSyncError
from roll.pipelines import credit
from roll.pipelines.common import StageTimer, example_samples, init_ray, prepare_model, write_resolved_config
from roll.pipelines.onpolicy_distill import teacher_advantages
from roll.pipelines.preflight import RunInputs, preflight
from roll.pipelines.recovery import RestartBudget
from roll.pipelines.roles import Role, RoleSet, cluster_options
from roll.pipelines.run_dir import RunDirectory
from roll.pipelines.run_loop import RunLoop
from roll.pipelines.scheduler_slot import SchedulerSlot
from roll.pipelines.sft import sft_warm_start, warm_started_model
from roll.pipelines.supervisor import Supervisor
from roll.pipelines.weight_publisher import WeightPublisher, rollout_transfer
from roll.pipelines.worker_specs import device_roles, plan_workers, policy_roles
from roll.rollout.backend import RewardDispatch, RolloutBackend
from roll.tracking import Tracker
from roll.utils.signals import set_activity
from roll.workers.actor_losses import MISMATCH_METRICS


class PolicyPipeline(RunLoop):
    """Trains ``config.actor`` with ``config.algorithm`` on samples the scheduler hands it, one batch per
    step. ``inputs``: what ``preflight(config)`` returned, when the caller ran it already (the CLI does,
    before importing Ray); otherwise preflight runs here. Nothing is written and no model is built before
    it has passed. ``resume``: ``"latest"`` or a checkpoint (or run) directory to go on from;
    ``overwrite``: start again in an output directory that holds a run (see ``RunDirectory``)."""

    restartable = (WorkerError, WeightSyncError)
    # Roles whose loss the scheduler cannot outlive: it starts again from its state with new workers.
    scheduler_roles: frozenset[str] = frozenset({"rollout"})
    # A step's batch has a varying number of rows (one per turn: step-wise agentic), see plan_workers.
    rows_vary = False

    def __init__(
        self, config: Any, inputs: RunInputs | None = None, resume: str | None = None, overwrite: bool = False
    ):
        problems = resolve_world_sizes(config)  # a config built in code has not been through load_config
        if problems:
            raise ConfigError("\n".join(problems))
        self.config = config
        # The run's roles: their devices, live clusters (and standbys) and turns on shared devices.
        self.role_set = RoleSet({}, standby=config.checkpoint.standby_workers, **cluster_options(config))
        # The one count of the weights version the rollout workers hold; the scheduler is told each one.
        self.publisher = WeightPublisher(
            on_version=lambda version: self.scheduler.set_weights_version(version),
            before_sync=lambda: self.role_set.colocation.use("actor", "rollout"),
        )
        self.schedulers = SchedulerSlot(
            self.make_scheduler, self.reward_dispatch, lambda: self.publisher.version
        )
        self.run_dir: RunDirectory | None = None
        inputs = inputs or preflight(config)
        self.tokenizer = inputs.tokenizer
        self.take_inputs(inputs)
        self.budget = RestartBudget(config.checkpoint.max_restarts)
        self.supervisor = Supervisor(
            self.role_set,
            self.budget,
            self.publisher,
            self._weight_sync,
            self.scheduler_roles,
            lambda keeps: self.schedulers.rebuilt(keeps, lambda: (self.rollout, self.actor)),
        )
        try:
            self.run_dir = RunDirectory(config.output_dir, resume, overwrite)
            # Ray and the devices of a joined cluster come before anything is written: an impossible
            # mapping fails here, not after the SFT warm start.
            init_ray(config.ray)
            self.role_set.place(device_roles(config), config.ray.call_timeout_s)
            write_resolved_config(config, config.output_dir)
            self.model_path = prepare_model(config.model, config.output_dir)
            if config.sft_warm_start is not None and self.run_dir.resume_from is not None:
                self.model_path = warm_started_model(config.output_dir)  # its checkpoints go on from it
            elif config.sft_warm_start is not None:
                self.model_path = self.warm_start(inputs)
            self._start_workers()
            self.role_set.fill_standby()
        except BaseException:
            self.shutdown()  # whatever started before the failure (or a stop signal) is released
            raise

    # ----- what a pipeline gives -----------------------------------------------------------------------

    @abc.abstractmethod
    def take_inputs(self, inputs: RunInputs) -> None:
        """Keep what preflight loaded (datasets, held-out tasks); sets ``eval_prompts`` or ``evaluates``."""

    @abc.abstractmethod
    def warm_start(self, inputs: RunInputs) -> str:
        """SFT before RL (``sft_warm_start``); returns the model RL starts from."""

    @abc.abstractmethod
    def make_scheduler(self, backend: RolloutBackend, id_prefix: str) -> Any:
        """The scheduler of this run's samples over ``backend`` (``next_batch``, ``state_dict``, ...)."""

    def extra_roles(self) -> dict[str, Role]:
        """Roles beside actor, critic, rollout and reference (reward, environment workers)."""
        return {}

    def reward_dispatch(self) -> RewardDispatch:
        """Where finished samples are scored (nowhere by default: the scheduler scores them itself)."""
        return RewardDispatch(None, self.tokenizer.pad_token_id)

    def step_metrics(self, batch: Batch, scores: torch.Tensor) -> dict[str, float]:
        """The pipeline's own metrics of a training batch."""
        return {}

    def run_sft(self, inputs: RunInputs, train: Any, **sections: Any) -> str:
        """SFT before RL on the actor's devices (``sft.sft_warm_start``); returns the fine-tuned model."""
        placements = self.role_set.placements("actor")
        return sft_warm_start(self.config, self.model_path, placements, inputs, train, **sections)

    # ----- starting the workers -----------------------------------------------------------------------

    def _start_workers(self) -> None:
        """The roles of the config's plan started and set up (but those still running: stateless workers
        that outlived a lost trainer), then the scheduler and the weight transfer."""
        cfg = self.config
        set_activity("starting the workers")
        self.before_start()
        plan = self.plan = plan_workers(cfg, self.model_path, self.rows_vary)
        self.kl_coef = cfg.algorithm.kl_coef  # moves each step when algorithm.kl_target is set
        self.role_set.roles = policy_roles(cfg, plan, self.extra_roles())
        started = self.role_set.start()
        if "rollout" in started:
            self.publisher.reset()
        self.generator_role = "actor" if plan.hybrid_engine else "rollout"
        self.role_set.set_up(started)
        self.schedulers.start(self.rollout, self.actor)
        if self.rollout is not None:
            self.publisher.connect(self._weight_sync())

    def before_start(self) -> None:  # noqa: B027 - optional hook
        """Before the workers start (and start again after a restart)."""

    @property
    def scheduler(self) -> Any:
        """The scheduler of this run's samples (a new one after each recovery of its workers)."""
        return self.schedulers.current

    def _weight_sync(self) -> WeightSync:
        timeout_s = self.config.ray.call_timeout_s
        return rollout_transfer(self.role_set, self.plan, len(self.tokenizer), self.config.seed, timeout_s)

    # ----- the run loop's hooks ------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        return self.config.steps

    def on_start(self, tracker: Tracker) -> None:
        note = off_policy_note(self.config)
        if note is not None:
            tracker.print(note)

    def finish(
        self, tracker: Tracker, results: dict[str, float], metrics: dict[str, float]
    ) -> dict[str, float]:
        """Save the final model (and critic); returns the final metrics (eval before/after included)."""
        cfg = self.config
        results.update(metrics)
        if self.evaluates and "eval/score" in metrics:
            results["eval/score_after"] = metrics["eval/score"]
            tracker.print(
                f"eval/score before RL {results.get('eval/score_before', float('nan')):.3f} -> after RL "
                f"{results['eval/score_after']:.3f}"
            )
        set_activity("saving the final model")
        final = self.actor.save_pretrained(str(Path(cfg.output_dir) / "model"))
        if cfg.actor.lora is not None:
            tracker.print(
                f"final LoRA adapter saved to {final}; `roll export {cfg.output_dir} --merge` writes the "
                "merged model"
            )
        else:
            tracker.print(f"final model saved to {final}")
        if self.critic is not None:
            self.critic.save_pretrained(str(Path(cfg.output_dir) / "critic"))
        return results

    def evaluate_guarded(self) -> dict[str, float]:
        return self.supervisor.guard(self.evaluate)

    # ----- checkpoints and recovery --------------------------------------------------------------------

    def driver_state(self) -> dict[str, object]:
        """Beside the trainers' state: every other worker's RNG, the scheduler's state, the KL coef."""
        # First, so that a worker lost here is replaced before the scheduler's state is read.
        worker_rng = self.supervisor.guard(
            lambda: {
                role: c.rng_state()
                for role, c in self.clusters().items()
                if not self.role_set.roles[role].trainer
            }
        )
        return {"kl_coef": self.kl_coef, "scheduler": self.scheduler.state_dict(), "worker_rng": worker_rng}

    def trainers(self) -> dict[str, Cluster]:
        return self.role_set.trainers()

    def load_driver_state(self, state: dict[str, Any]) -> None:
        step = state["step"]
        clusters = self.clusters()
        for role, states in state["worker_rng"].items():
            if role in clusters:
                clusters[role].set_rng_state(states)
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_coef = state["kl_coef"]
        self.publisher.restore(step)

    def clusters(self) -> dict[str, Cluster]:
        return self.role_set.clusters()

    actor = property(lambda self: self.role_set.get("actor"))
    critic = property(lambda self: self.role_set.get("critic"))
    rollout = property(lambda self: self.role_set.get("rollout"))
    reference = property(lambda self: self.role_set.get("reference"))
    generator = property(lambda self: self.role_set.get(self.generator_role))  # the actor: hybrid engine

    def restart_workers(self, lost: dict[str, list[int]]) -> str:
        return self.supervisor.restart_workers(lost, self._stop_workers, self._start_workers)

    def after_restart(self) -> None:
        self.role_set.fill_standby()

    # ----- the step ------------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        cfg, algo = self.config, self.config.algorithm
        timer = StageTimer()
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        # Samples, each scored as it finishes (the pipeline's scheduler).
        with timer("rollout"), self.role_set.on_device(self.generator_role, metrics=metrics):
            batch, rollout_metrics = self.supervisor.guard(lambda: self.scheduler.next_batch(step))
        metrics.update(rollout_metrics)
        # Lengths count every attended response token; credit, the KL and the losses only trained ones.
        lengths = batch["response_mask"].sum(dim=1).float()
        mask = loss_mask(batch).float()
        scores = batch["scores"]
        # Rows that only fill the batch to a divisor (trained on by nobody) stay out of the metrics.
        real = ~batch["padding"] if "padding" in batch else torch.ones(len(batch), dtype=torch.bool)
        shaped = credit.shape_scores(scores, lengths, algo.reward_shaping, cfg.rollout.max_new_tokens)
        with timer("logprobs"):
            batch = self._forward_passes(batch, metrics)

        token_rewards = credit.token_level_rewards(
            scores, shaped, mask, batch["token_rewards"], response_mask=batch["response_mask"]
        )
        if self.uses_reference and algo.kl_penalty == "reward":
            kl = credit.kl_per_token(batch["old_logprobs"], batch["ref_logprobs"], mask, algo.kl_estimator)
            token_rewards = token_rewards - self.kl_coef * kl
            metrics["reward/kl"] = masked_mean(kl, mask).item()
        advantages, returns = credit.compute_advantages(
            algo,
            token_rewards,
            mask,
            batch["group_index"],
            batch["values"] if self.critic else None,
            per_turn={key: batch[key] for key in credit.PER_TURN_FIELDS if key in batch},
        )
        distill = getattr(cfg, "distill", None)
        if distill is not None:
            with timer("teacher"):
                taught, distill_metrics = teacher_advantages(
                    distill,
                    batch,
                    mask,
                    real,
                    lambda role, rows: self._teacher_logprobs(role, rows, metrics),
                    lambda role: self.role_set.live[role].world_size,
                )
            metrics.update(distill_metrics)
            advantages = taught if distill.mode == "pure" else advantages + taught
            returns = advantages  # no critic reads them (refused at load)
        batch["advantages"], batch["returns"] = advantages, returns

        if self.critic is not None:
            with timer("critic"), self.role_set.on_device("critic", metrics=metrics):
                metrics.update({f"critic/{k}": v for k, v in self.critic.train_step(_tensors(batch)).items()})
        with timer("train"), self.role_set.on_device("actor", metrics=metrics):
            kl_loss_coef = self.kl_coef if algo.kl_penalty == "loss" else 0.0
            trained = self.actor.train_step(_tensors(batch), kl_loss_coef)
            # The engine/trainer mismatch describes the rollout's samples: logged beside the other rollout/*.
            metrics.update({f"rollout/{k}": trained.pop(k) for k in MISMATCH_METRICS if k in trained})
            metrics.update({f"actor/{k}": v for k, v in trained.items()})
        if self.publisher.sends:
            with timer("sync"), self.role_set.on_device("actor", "rollout", metrics=metrics):
                metrics.update(self.supervisor.guard(self.publisher.publish))
        else:
            self.publisher.publish()
        if self.uses_reference:
            metrics["actor/kl_coef"] = self.kl_coef
            self._adapt_kl_coef(metrics, len(batch))

        step_time = time.perf_counter() - start
        tokens = float(lengths[real].sum() + batch["prompt_mask"][real].sum())
        self.recent_samples = example_samples(batch, scores, self.tokenizer, cfg.tracking.samples_per_step)
        metrics.update(self.step_metrics(batch, scores[real]))
        return {
            **credit.reward_metrics(
                batch,
                shaped if credit.shaping_enabled(algo.reward_shaping) else None,
                real,
                grouped=self.plan.samples_per_prompt > 1,
            ),
            **credit.advantage_metrics(advantages, returns, mask),
            **metrics,
            **timer.metrics(),
            "time/step_s": step_time,
            "throughput/tokens_per_s": tokens / step_time,
        }

    def _teacher_logprobs(self, role: str, rows: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """On-policy distillation: a teacher's logprobs of the sampled tokens of ``rows``."""
        with self.role_set.on_device(role, metrics=metrics):
            scored = self.supervisor.guard(
                lambda: self.role_set.get(role).compute_logprobs(rows, self.config.rollout.temperature)
            )
        return scored["logprobs"]

    def _forward_passes(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        """Reference logprobs, old-policy logprobs and critic values, as needed.

        One after another: each worker uses every core of the node, so on a shared CPU two passes at
        once oversubscribe the threads and take longer than both in turn (docs/algorithms.md)."""
        temperature = self.config.rollout.temperature
        # The initial policy: the reference workers, or with LoRA the actor with its adapter switched off.
        if self.uses_reference and self.reference is None:
            with self.role_set.on_device("actor", metrics=metrics):
                scored = self.actor.compute_reference_logprobs(_tensors(batch), temperature)
            batch["ref_logprobs"] = scored["logprobs"]
        elif self.uses_reference:
            with self.role_set.on_device("reference", metrics=metrics):
                scored = self.supervisor.guard(
                    lambda: self.reference.compute_logprobs(_tensors(batch), temperature)
                )
            batch["ref_logprobs"] = scored["logprobs"]
        if self.plan.needs_old_logprobs:
            with self.role_set.on_device("actor", metrics=metrics):
                batch["old_logprobs"] = self.actor.compute_logprobs(_tensors(batch), temperature)["logprobs"]
        if self.critic is not None:
            with self.role_set.on_device("critic", metrics=metrics):
                batch["values"] = self.critic.compute_values(_tensors(batch))["values"]
        return batch

    @property
    def uses_reference(self) -> bool:
        """Whether the step has a KL term to the initial policy."""
        return self.config.algorithm.kl_coef > 0

    def _adapt_kl_coef(self, metrics: dict[str, float], batch_size: int) -> None:
        """With ``algorithm.kl_target``, steer the KL coefficient toward the target after each step."""
        algo = self.config.algorithm
        if algo.kl_target is None:
            return
        observed = metrics["reward/kl"] if algo.kl_penalty == "reward" else metrics["actor/kl"]
        self.kl_coef = adaptive_kl_coef(self.kl_coef, observed, algo.kl_target, algo.kl_horizon, batch_size)

    # ----- shutdown ------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stop_workers()
        self.role_set.shutdown()
        if self.run_dir is not None:
            self.run_dir.release()

    def _stop_workers(self, keep: frozenset[str] | set[str] = frozenset()) -> None:
        """Stop the scheduler, the weight transfer and every worker but the roles in ``keep``."""
        self.schedulers.close(keeps_rollout="rollout" in keep and self.rollout is not None)
        self.publisher.close()
        self.role_set.stop(keep)


def _tensors(batch: Batch) -> Batch:
    """The tensor fields, and the rows' images when there are any: trainer, reference and critic workers
    read no text."""
    return batch.select_keys([*batch.tensors, *([IMAGES] if IMAGES in batch else [])])
