"""SFT: supervised fine-tuning on prompt/response rows, with greedy held-out evaluation."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll.config.loader import ConfigError
from roll.config.sft import SFTConfig
from roll.data.batch import Batch
from roll.data.columns import ANSWER
from roll.data.padding import right_pad
from roll.pipelines.common import prompt_batch, response_tensors
from roll.pipelines.preflight import RunInputs
from roll.pipelines.roles import Role
from roll.pipelines.trainer_pipeline import TrainerPipeline
from roll.pipelines.worker_specs import from_section
from roll.workers.actor import ActorSpec, ActorWorker, CrossEntropySpec, OptimizerSpec
from roll.workers.base import ModelSpec

if TYPE_CHECKING:
    from roll.distributed.placement import RankPlacement


class SFTPipeline(TrainerPipeline):
    """Supervised fine-tuning (``SFTConfig``): the token-mean cross-entropy of the dataset's responses."""

    def __init__(
        self,
        config: SFTConfig,
        inputs: RunInputs | None = None,
        name: str = "SFT",
        resume: str | None = None,
        overwrite: bool = False,
        placements: list[RankPlacement] | None = None,
    ):
        """``name`` is how the line printed when the run is stopped calls this training ("SFT warm-start
        step 12 of 250"); the rest is ``TrainerPipeline``'s."""
        self.name = name
        super().__init__(config, inputs, resume, overwrite, placements)

    def read_inputs(self, inputs: RunInputs) -> None:
        self.train_rows, self.eval_prompts = inputs.train, inputs.eval

    def roles(self) -> dict[str, Role]:
        config, train = self.config, self.config.train
        spec = from_section(
            ActorSpec,
            train,
            model=from_section(ModelSpec, config.model, path=self.model_path, seed=config.seed),
            optimizer=from_section(OptimizerSpec, train, total_steps=train.steps),
            loss=CrossEntropySpec(),
            collective_timeout_s=config.ray.call_timeout_s,
        )
        return {"actor": Role("actor", ActorWorker, self.world_size, spec, trainer=True)}

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        batch = self.batch(self.order.next_indices())
        metrics = {f"sft/{k}": v for k, v in self.actor.train_step(batch).items()}
        metrics["sft/samples"] = len(batch)  # `roll plot --x samples` sums them
        metrics["time/step_s"] = time.perf_counter() - start
        return metrics

    def restart_action(self, last: Path | None) -> str:
        return f"restarting the trainer from {last or 'the first step'}"

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
        return self.task_score(self.eval_prompts)


def sft_warm_start(
    rl: Any, model: str, ranks: list[RankPlacement] | None, inputs: RunInputs, train: Any, **sections: Any
) -> str:
    """SFT as its own pipeline, part of the RL run of config ``rl``: from the model RL starts with
    (``model``), into ``<output_dir>/sft``, on the actor's devices and ``ranks``, with no checkpoints of
    its own (a resumed run skips it and goes on from ``warm_started_model``). ``sections``: the SFT
    config's other sections (data, eval, reward). Returns the fine-tuned model's path, saved in float32."""
    sft_config = SFTConfig(
        run_name=f"{rl.run_name}-sft",
        output_dir=str(Path(rl.output_dir) / "sft"),
        seed=rl.seed,
        imports=rl.imports,
        model=dataclasses.replace(rl.model, path=model, tiny=None),
        train=train,
        checkpoint=dataclasses.replace(rl.checkpoint, every_steps=0, max_restarts=0, standby_workers=False),
        tracking=rl.tracking,
        ray=rl.ray,
        **sections,
    )
    warm = SFTPipeline(sft_config, inputs, "SFT warm-start", overwrite=True, placements=ranks)
    # RL starts from what SFT trained: its float32 master weights, not a copy rounded to model.dtype (the
    # engines cast it to the inference dtype as they load it).
    warm.saved_dtype = "float32"
    return warm.run()


def warm_started_model(output_dir: str) -> str:
    """The warm start's model, saved by the run being resumed: RL goes on from the checkpoint and the
    reference model is this one, as before."""
    path = Path(output_dir) / "sft" / "model"
    if not (path / "config.json").is_file():
        raise ConfigError(f"the run being resumed has no SFT warm-start model at {path}")
    return str(path)
