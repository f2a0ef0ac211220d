"""SFT: supervised fine-tuning on prompt/response rows, with greedy held-out evaluation."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from roll import checkpoint
from roll.config.sft import SFTConfig
from roll.data.batch import Batch
from roll.data.dataset import PromptIterator
from roll.distributed.cluster import Cluster, WorkerError
from roll.distributed.liveness import Liveness
from roll.distributed.ray_utils import init_ray
from roll.pipelines.common import (
    begin_run,
    checkpoint_due,
    evaluate,
    is_eval_step,
    load_run_checkpoint,
    open_tracker,
    prepare_model,
    prompt_batch,
    response_tensors,
    save_run_checkpoint,
    setup_trainer,
    write_resolved_config,
)
from roll.pipelines.preflight import RunInputs, preflight
from roll.pipelines.recovery import RestartBudget, lost_workers
from roll.pipelines.run_dir import RunDirectory
from roll.pipelines.worker_specs import from_section
from roll.rewards import score_response
from roll.strategies.sampling import SamplingParams
from roll.tracking import Tracker
from roll.utils import signals
from roll.utils.signals import set_activity
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
from roll.workers.base import ModelSpec


class SFTPipeline:
    def __init__(
        self,
        config: SFTConfig,
        inputs: RunInputs | None = None,
        name: str = "SFT",
        resume: str | None = None,
        overwrite: bool = False,
    ):
        """``inputs``: what ``preflight(config)`` returned, when the caller ran it already; otherwise
        preflight runs here, before anything is written. ``name`` is how the line printed when the run
        is stopped calls this training ("SFT warm-start step 12 of 250"). ``resume`` and ``overwrite``:
        see ``RunDirectory``."""
        self.config = config
        self.name = name
        inputs = inputs or preflight(config)
        self.tokenizer, self.train_rows, self.eval_prompts = inputs.tokenizer, inputs.train, inputs.eval
        self.eval_sampling = SamplingParams(max_new_tokens=config.eval.max_new_tokens, greedy=True)
        self.budget = RestartBudget(config.checkpoint.max_restarts)
        self.actor: Cluster | None = None
        self.run_dir = RunDirectory(config.output_dir, resume, overwrite)
        try:
            init_ray(config.ray)
            write_resolved_config(config, config.output_dir)
            self.model_path = prepare_model(config.model, config.output_dir)
            self._start_actor()
        except BaseException:
            self.shutdown()
            raise

    def _start_actor(self) -> None:
        config, train = self.config, self.config.train
        self.order = PromptIterator(self.train_rows.rows, train.batch_size, seed=config.seed)
        spec = from_section(
            ActorSpec,
            train,
            model=ModelSpec(path=self.model_path, dtype=config.model.dtype, seed=config.seed),
            optimizer=from_section(OptimizerSpec, train, total_steps=train.steps),
            collective_timeout_s=config.ray.call_timeout_s,
        )
        set_activity(f"starting the {self.name} worker")
        self.actor = Cluster(
            "actor",
            ActorWorker,
            train.world_size,
            spec,
            config.ray.call_timeout_s,
            plugins=config.imports,
            liveness=Liveness.from_config(config.ray),
        )
        setup_trainer(self.actor)

    def run(self) -> str:
        """Train, evaluate, save; returns the path of the fine-tuned model (Hugging Face format)."""
        try:
            return self._train()
        finally:
            # Actors would die with the driver anyway; releasing them now frees a joined cluster.
            self.shutdown()

    def shutdown(self) -> None:
        if self.actor is not None:
            self.actor.kill()
            self.actor = None
        self.run_dir.release()

    def _train(self) -> str:
        cfg = self.config
        with open_tracker(cfg, cfg.train.steps) as tracker:
            evaluate_before = self.evaluate if self.eval_prompts is not None else None
            last, results = begin_run(tracker, self.run_dir.resume_from, self._restore, evaluate_before)
            metrics: dict[str, float] = {}
            step = last + 1
            while step <= cfg.train.steps:
                set_activity(f"{self.name} step {step} of {cfg.train.steps}")
                try:
                    with signals.deferred(cfg.checkpoint.every_steps > 0):
                        metrics = self.step(step)
                    metrics["recovery/restarts"] = self.budget.restarts
                    tracker.log(step, metrics)
                    if checkpoint_due(cfg.checkpoint, step, cfg.train.steps):
                        self.save_checkpoint(step, results, tracker)
                except WorkerError as error:
                    step = self._restart(error, tracker, results) + 1
                    continue
                signals.raise_if_received()
                step += 1
            if "eval/score" in metrics and "eval/score_before" in results:
                tracker.print(
                    f"SFT eval/score {results['eval/score_before']:.3f} -> {metrics['eval/score']:.3f}"
                )
            path = self.actor.save_pretrained(str(Path(cfg.output_dir) / "model"))
            tracker.print(f"SFT model saved to {path}")
        return path

    def step(self, step: int) -> dict[str, float]:
        cfg = self.config
        start = time.perf_counter()
        metrics = {
            f"sft/{k}": v for k, v in self.actor.sft_step(self.batch(self.order.next_indices())).items()
        }
        metrics["time/step_s"] = time.perf_counter() - start
        if self.eval_prompts is not None and is_eval_step(cfg.eval, step, cfg.train.steps):
            metrics.update(self.evaluate())
        return metrics

    def save_checkpoint(self, step: int, results: dict[str, float], tracker: Tracker) -> Path:
        """Weights, optimizer, LR schedule and RNG of every rank, and the data order."""
        driver_state = {"results": dict(results), "data_order": self.order.state_dict()}
        return save_run_checkpoint(self.config, step, {"actor": self.actor}, lambda: driver_state, tracker)

    def _restore(self, path: Path, results: dict[str, float]) -> int:
        state = load_run_checkpoint(path, {"actor": self.actor})
        self.order.load_state_dict(state["data_order"])
        results.clear()
        results.update(state["results"])
        return state["step"]

    def _restart(self, error: WorkerError, tracker: Tracker, results: dict[str, float]) -> int:
        """The trainer started again from the last valid checkpoint (or the first step)."""
        lost = lost_workers(error, {"actor": self.actor})
        last = checkpoint.latest_valid(checkpoint.checkpoints_root(self.config.output_dir))
        self.budget.spend(error, lost, f"restarting the trainer from {last or 'the first step'}")
        tracker.print(f"WARNING: {self.budget.events[-1]}")
        self.actor.kill()
        self._start_actor()
        step = self._restore(last, results) if last is not None else 0
        if last is None:
            results.pop("eval/score", None)
        tracker.rewind(step)
        return step

    def batch(self, indices: list[int]) -> Batch:
        batch = prompt_batch(self.train_rows, indices, self.tokenizer.pad_token_id)
        key = self.config.data.response_key
        for name, tensor in response_tensors(self.tokenizer, [str(s[key]) for s in batch["sample"]]).items():
            batch[name] = tensor
        return batch

    def evaluate(self) -> dict[str, float]:
        assert self.eval_prompts is not None
        return evaluate(
            self.eval_prompts,
            generate=lambda batch, params: self.actor.generate(batch, params),
            score=self.score,
            params=self.eval_sampling,
            batch_size=self.config.eval.batch_size,
            pad_id=self.tokenizer.pad_token_id,
            max_prompts=self.config.eval.max_prompts,
            divisor=self.config.train.world_size,
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
