"""SFT: supervised fine-tuning on prompt/response rows, with greedy held-out evaluation."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from roll.config.sft import SFTConfig
from roll.data.batch import Batch
from roll.data.dataset import PromptIterator
from roll.distributed.cluster import Cluster
from roll.distributed.liveness import Liveness
from roll.distributed.ray_utils import init_ray
from roll.pipelines.common import (
    evaluate,
    is_eval_step,
    open_tracker,
    prepare_model,
    prompt_batch,
    response_tensors,
    setup_trainer,
    write_resolved_config,
)
from roll.pipelines.preflight import RunInputs, preflight
from roll.pipelines.worker_specs import from_section
from roll.rewards import score_response
from roll.strategies.sampling import SamplingParams
from roll.utils.signals import set_activity
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
from roll.workers.base import ModelSpec


class SFTPipeline:
    def __init__(self, config: SFTConfig, inputs: RunInputs | None = None, name: str = "SFT"):
        """``inputs``: what ``preflight(config)`` returned, when the caller ran it already; otherwise
        preflight runs here, before anything is written. ``name`` is how the line printed when the run
        is stopped calls this training ("SFT warm-start step 12 of 250")."""
        self.config = config
        self.name = name
        inputs = inputs or preflight(config)
        self.tokenizer, self.train_rows, self.eval_prompts = inputs.tokenizer, inputs.train, inputs.eval
        self.order = PromptIterator(self.train_rows.rows, config.train.batch_size, seed=config.seed)
        self.eval_sampling = SamplingParams(max_new_tokens=config.eval.max_new_tokens, greedy=True)
        init_ray(config.ray)
        write_resolved_config(config, config.output_dir)
        self.model_path = prepare_model(config.model, config.output_dir)
        train = config.train
        spec = from_section(
            ActorSpec,
            train,
            model=ModelSpec(path=self.model_path, dtype=config.model.dtype, seed=config.seed),
            optimizer=from_section(OptimizerSpec, train, total_steps=train.steps),
            collective_timeout_s=config.ray.call_timeout_s,
        )
        set_activity(f"starting the {name} worker")
        self.actor = Cluster(
            "actor",
            ActorWorker,
            train.world_size,
            spec,
            config.ray.call_timeout_s,
            plugins=config.imports,
            liveness=Liveness.from_config(config.ray),
        )
        try:
            setup_trainer(self.actor)
        except BaseException:
            self.actor.kill()
            raise

    def run(self) -> str:
        """Train, evaluate, save; returns the path of the fine-tuned model (Hugging Face format)."""
        try:
            return self._train()
        finally:
            # Actors would die with the driver anyway; releasing them now frees a joined cluster.
            self.actor.kill()

    def _train(self) -> str:
        cfg = self.config
        with open_tracker(cfg, cfg.train.steps) as tracker:
            if self.eval_prompts is not None:
                before = self.evaluate()
                tracker.log(0, before)
            metrics: dict[str, float] = {}
            for step in range(1, cfg.train.steps + 1):
                set_activity(f"{self.name} step {step} of {cfg.train.steps}")
                start = time.perf_counter()
                metrics = {
                    f"sft/{k}": v
                    for k, v in self.actor.sft_step(self.batch(self.order.next_indices())).items()
                }
                metrics["time/step_s"] = time.perf_counter() - start
                if self.eval_prompts is not None and is_eval_step(cfg.eval, step, cfg.train.steps):
                    metrics.update(self.evaluate())
                tracker.log(step, metrics)
            if self.eval_prompts is not None:
                tracker.print(f"SFT eval/score {before['eval/score']:.3f} -> {metrics['eval/score']:.3f}")
            path = self.actor.save_pretrained(str(Path(cfg.output_dir) / "model"))
            tracker.print(f"SFT model saved to {path}")
        return path

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
