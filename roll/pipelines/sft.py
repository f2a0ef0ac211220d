"""SFT: supervised fine-tuning on prompt/response rows, with greedy held-out evaluation."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from roll.config.sft import SFTConfig
from roll.data.batch import Batch
from roll.data.columns import ANSWER
from roll.data.dataset import PromptIterator
from roll.data.padding import right_pad
from roll.distributed.cluster import Cluster
from roll.distributed.device_mapping import role_devices
from roll.distributed.liveness import Liveness
from roll.pipelines.common import (
    evaluate,
    init_ray,
    place_trainer,
    prepare_model,
    prompt_batch,
    response_tensors,
    setup_trainer,
    write_resolved_config,
)
from roll.pipelines.preflight import RunInputs, preflight
from roll.pipelines.recovery import RestartBudget
from roll.pipelines.run_dir import RunDirectory
from roll.pipelines.run_loop import RunLoop
from roll.pipelines.worker_specs import from_section
from roll.rewards import score_response
from roll.strategies.requests import SamplingParams
from roll.tracking import Tracker
from roll.utils.signals import set_activity
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
from roll.workers.base import ModelSpec

if TYPE_CHECKING:
    from roll.distributed.placement import DeviceTable, RankPlacement


class SFTPipeline(RunLoop):
    def __init__(
        self,
        config: SFTConfig,
        inputs: RunInputs | None = None,
        name: str = "SFT",
        resume: str | None = None,
        overwrite: bool = False,
        placements: list[RankPlacement] | None = None,
    ):
        """``inputs``: what ``preflight(config)`` returned, when the caller ran it already; otherwise
        preflight runs here, before anything is written. ``name`` is how the line printed when the run
        is stopped calls this training ("SFT warm-start step 12 of 250"). ``resume`` and ``overwrite``:
        see ``RunDirectory``. ``placements``: the ranks' devices when the caller holds them (an RL warm
        start on the actor's); otherwise ``train.device_mapping`` is placed here, or the ranks are CPU
        ranks."""
        self.config = config
        self.name = name
        self.placements = placements
        self.device_table: DeviceTable | None = None
        inputs = inputs or preflight(config)
        self.tokenizer, self.train_rows, self.eval_prompts = inputs.tokenizer, inputs.train, inputs.eval
        self.eval_sampling = SamplingParams(max_new_tokens=config.eval.max_new_tokens, greedy=True)
        self.budget = RestartBudget(config.checkpoint.max_restarts)
        self.actor: Cluster | None = None
        self.run_dir = RunDirectory(config.output_dir, resume, overwrite)
        try:
            init_ray(config.ray)
            devices = role_devices("train", config.train.device_mapping, config.train.world_size)
            self.world_size = len(placements) if placements is not None else devices.world_size
            if placements is None:
                self.device_table, self.placements = place_trainer(devices, config.ray.call_timeout_s)
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
            model=from_section(ModelSpec, config.model, path=self.model_path, seed=config.seed),
            optimizer=from_section(OptimizerSpec, train, total_steps=train.steps),
            collective_timeout_s=config.ray.call_timeout_s,
        )
        set_activity(f"starting the {self.name} worker")
        self.actor = Cluster(
            "actor",
            ActorWorker,
            self.world_size,
            spec,
            config.ray.call_timeout_s,
            plugins=config.imports,
            liveness=Liveness.from_config(config.ray),
            placements=self.placements,
        )
        setup_trainer(self.actor)

    @property
    def total_steps(self) -> int:
        return self.config.train.steps

    def shutdown(self) -> None:
        if self.actor is not None:
            self.actor.kill()
            self.actor = None
        if self.device_table is not None:  # a table the caller holds stays theirs
            self.device_table.remove()
            self.device_table = None
        self.run_dir.release()

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        batch = self.batch(self.order.next_indices())
        metrics = {f"sft/{k}": v for k, v in self.actor.sft_step(batch).items()}
        metrics["sft/samples"] = len(batch)  # `roll plot --x samples` sums them
        metrics["time/step_s"] = time.perf_counter() - start
        return metrics

    def finish(self, tracker: Tracker, results: dict[str, float], metrics: dict[str, float]) -> str:
        """Save the fine-tuned model; returns its path (Hugging Face format)."""
        if "eval/score" in metrics and "eval/score_before" in results:
            tracker.print(f"SFT eval/score {results['eval/score_before']:.3f} -> {metrics['eval/score']:.3f}")
        path = self.actor.save_pretrained(str(Path(self.config.output_dir) / "model"))
        tracker.print(f"SFT model saved to {path}")
        return path

    def clusters(self) -> dict[str, Cluster]:
        return {"actor": self.actor} if self.actor is not None else {}

    def trainers(self) -> dict[str, Cluster]:
        return {"actor": self.actor}

    def driver_state(self) -> dict[str, object]:
        return {"data_order": self.order.state_dict()}

    def load_driver_state(self, state: dict) -> None:
        self.order.load_state_dict(state["data_order"])

    def restart_action(self, last: Path | None) -> str:
        return f"restarting the trainer from {last or 'the first step'}"

    def restart_workers(self, lost: dict[str, list[int]]) -> str:
        start = time.perf_counter()
        self.actor.kill()
        self._start_actor()
        return f"starting the trainer {time.perf_counter() - start:.1f} s"

    def batch(self, indices: list[int]) -> Batch:
        batch = prompt_batch(self.train_rows, indices, self.tokenizer.pad_token_id)
        rows = batch["sample"]
        if "response_ids" in rows[0]:
            # Rows given as tokens (an expert's episodes): trained where their loss_mask is 1, so the
            # observations between the expert's turns are attended and not trained on.
            pad = self.tokenizer.pad_token_id
            batch["response_ids"], batch["response_mask"] = right_pad([r["response_ids"] for r in rows], pad)
            batch["loss_mask"], _ = right_pad([r["loss_mask"] for r in rows], 0)
            return batch
        answers = [str(sample[ANSWER]) for sample in batch["sample"]]
        for name, tensor in response_tensors(self.tokenizer, answers).items():
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
