"""The shell of the pipelines that train one model on a dataset (SFT, DPO, offline distillation): the run
directory, Ray, the trainer's devices, the model to start from, its workers and their restart, the data
order a checkpoint keeps, the greedy held-out score, and the saved model. A pipeline built on it gives
what its algorithm adds: which rows it reads, the workers it starts, its step and its evaluation.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll.data.batch import Batch
from roll.data.dataset import PromptIterator
from roll.data.prompts import PromptSet
from roll.distributed.cluster import Cluster
from roll.distributed.device_mapping import role_devices
from roll.pipelines.common import evaluate, init_ray, prepare_model, write_resolved_config
from roll.pipelines.preflight import RunInputs, preflight
from roll.pipelines.recovery import RestartBudget
from roll.pipelines.roles import Role, RoleSet, cluster_options
from roll.pipelines.run_dir import RunDirectory
from roll.pipelines.run_loop import RunLoop
from roll.rewards import score_response
from roll.strategies.requests import SamplingParams
from roll.tracking import Tracker
from roll.utils.signals import set_activity

if TYPE_CHECKING:
    from roll.distributed.placement import RankPlacement


class TrainerPipeline(RunLoop):
    """One trained model (the ``actor`` cluster) and the workers that help it, over ``total_steps`` steps
    of ``batch_size`` rows drawn in a seeded order. ``trainer_key`` names the config section with the
    trainer's ``world_size``, ``device_mapping``, ``steps`` and ``batch_size``; ``label`` starts the
    lines the run prints and ``saved_as`` names what it saves."""

    trainer_key: str = "train"
    # The roles that may run on the trainer's devices (its ``device_mapping``), taking turns with it.
    device_roles: tuple[str, ...] = ("actor",)
    label: str = "SFT"
    saved_as: str = "SFT model"
    saved_dtype: str | None = None  # the saved model's dtype; None: model.dtype

    def __init__(
        self,
        config: Any,
        inputs: RunInputs | None = None,
        resume: str | None = None,
        overwrite: bool = False,
        placements: list[RankPlacement] | None = None,
    ):
        """``inputs``: what ``preflight(config)`` returned, when the caller ran it already; otherwise
        preflight runs here, before anything is written. ``resume`` and ``overwrite``: see
        ``RunDirectory``. ``placements``: the ranks' devices when the caller holds them (an RL warm start
        on the actor's); otherwise the section's ``device_mapping`` is placed here, or the ranks are CPU
        ranks."""
        self.config = config
        inputs = inputs or preflight(config)
        self.tokenizer = inputs.tokenizer
        self.read_inputs(inputs)
        self.eval_sampling = SamplingParams(max_new_tokens=config.eval.max_new_tokens, greedy=True)
        self.budget = RestartBudget(config.checkpoint.max_restarts)
        # The run's roles: the trainer and the models that help it (a reference, a teacher), all on the
        # trainer's devices, taking turns on them with offload as RL's colocated roles do.
        make = self._on_placements(placements) if placements is not None else None
        self.role_set = RoleSet({}, make, **cluster_options(config))
        self.order = self.fresh_order()
        self.run_dir = RunDirectory(config.output_dir, resume, overwrite)
        try:
            init_ray(config.ray)
            devices = role_devices(self.trainer_key, self.options.device_mapping, self.options.world_size)
            self.world_size = len(placements) if placements is not None else devices.world_size
            if placements is None:
                shared = [dataclasses.replace(devices, role=name) for name in self.device_roles]
                self.role_set.place(shared, config.ray.call_timeout_s)
            write_resolved_config(config, config.output_dir)
            self.model_path = prepare_model(config.model, config.output_dir)
            self.start_workers()
        except BaseException:
            self.shutdown()
            raise

    # ----- what a pipeline gives -----------------------------------------------------------------------

    @abc.abstractmethod
    def read_inputs(self, inputs: RunInputs) -> None:
        """Keep what the run reads of ``inputs``: at least ``train_rows`` (``.rows`` in draw order) and
        ``eval_prompts``."""

    @abc.abstractmethod
    def roles(self) -> dict[str, Role]:
        """The run's roles by name (the trained one as ``actor``), started and set up by ``start_workers``;
        each helper role's name must be in ``device_roles``."""

    # ----- the shell -----------------------------------------------------------------------------------

    @property
    def options(self) -> Any:
        """The config section of the trainer (``train`` or ``actor``)."""
        return getattr(self.config, self.trainer_key)

    @property
    def total_steps(self) -> int:
        return self.options.steps

    @property
    def actor(self) -> Cluster:
        return self.role_set.get("actor")

    def fresh_order(self) -> PromptIterator:
        return PromptIterator(self.train_rows.rows, self.options.batch_size, seed=self.config.seed)

    def start_workers(self) -> None:
        """Start the roles of ``roles()`` that are not running and set them up: colocated ones load one
        after another, each offloaded before the next (``RoleSet.set_up``)."""
        set_activity(f"starting the {self.label} workers")
        self.role_set.roles = self.roles()
        self.role_set.set_up(self.role_set.start())

    def on_device(self, *names: str, metrics: dict[str, float] | None = None) -> Any:
        """A stage that uses roles ``names``: they are made resident, the roles colocated with them
        offloaded (nothing moves when no role shares the trainer's devices)."""
        return self.role_set.on_device(*names, metrics=metrics)

    def _on_placements(self, placements: list[RankPlacement]) -> Any:
        """Start each role's ranks on the caller's ``placements`` (an RL warm start on the actor's)."""

        def make(role: Role) -> Cluster:
            return role.cluster(placements, **cluster_options(self.config))

        return make

    def clusters(self) -> dict[str, Cluster]:
        return self.role_set.clusters()

    def trainers(self) -> dict[str, Cluster]:
        return self.role_set.trainers()

    def shutdown(self) -> None:
        """Stop every worker; free the devices placed here (a table the caller holds stays theirs)."""
        self.role_set.shutdown()
        self.run_dir.release()

    def restart_workers(self, lost: dict[str, list[int]]) -> str:
        start = time.perf_counter()
        self.role_set.stop()
        # A checkpoint, when there is one, then restores the order; without one the run starts over.
        self.order = self.fresh_order()
        self.start_workers()
        return f"starting the workers {time.perf_counter() - start:.1f} s"

    def driver_state(self) -> dict[str, object]:
        return {"data_order": self.order.state_dict()}

    def load_driver_state(self, state: dict) -> None:
        self.order.load_state_dict(state["data_order"])

    def task_score(self, prompts: PromptSet) -> dict[str, float]:
        """``eval/score``: the trained model's greedy answers to ``prompts`` scored by ``reward``."""
        cfg = self.config
        with self.on_device("actor"):
            return evaluate(
                prompts,
                generate=lambda batch, params: self.actor.generate(batch, params),
                score=self.score,
                params=self.eval_sampling,
                batch_size=cfg.eval.batch_size,
                pad_id=self.tokenizer.pad_token_id,
                max_prompts=cfg.eval.max_prompts,
                divisor=self.world_size,
            )

    def score(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(
            [
                score_response(self.config.reward, prompt, response, sample).score
                for prompt, response, sample in zip(
                    batch["prompt_text"], batch["response_text"], batch["sample"]
                )
            ]
        )

    def finish(self, tracker: Tracker, results: dict[str, float], metrics: dict[str, float]) -> str:
        """Save the trained model (Hugging Face format); returns its path."""
        if "eval/score" in metrics and "eval/score_before" in results:
            tracker.print(
                f"{self.label} eval/score {results['eval/score_before']:.3f} -> {metrics['eval/score']:.3f}"
            )
        path = self.actor.save_pretrained(str(Path(self.config.output_dir) / "model"), self.saved_dtype)
        tracker.print(f"{self.saved_as} saved to {path}")
        return path
