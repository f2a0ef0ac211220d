"""Pieces every pipeline shares: model preparation, prompt encoding, evaluation, run-directory setup."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll.config.common import CheckpointConfig, EvalConfig, ModelConfig, RayConfig, cluster_to_join
from roll.data.batch import Batch
from roll.data.images import IMAGES
from roll.data.padding import left_pad, right_pad
from roll.data.prompts import PromptSet
from roll.distributed.cluster import Cluster
from roll.distributed.device_mapping import RoleDevices
from roll.distributed.ray_utils import start_ray
from roll.strategies.requests import SamplingParams
from roll.tracking import Tracker, read_tracker_state

if TYPE_CHECKING:
    from roll.distributed.placement import DeviceTable


def init_ray(cfg: RayConfig) -> None:
    """Join ``cfg.address`` (or ``RAY_ADDRESS``) when set, else start a local Ray.

    A no-op when Ray is already running in this process. A cluster that cannot be joined is a
    ConfigError naming the setting (``preflight.check_ray_address`` catches a dead address earlier)."""
    from roll.config.loader import ConfigError

    joined = cluster_to_join(cfg)
    try:
        start_ray(joined[1] if joined else None, num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
    except ConnectionError as e:
        if joined is None:  # a local Ray that fails to start is no setting's fault
            raise
        key, address = joined
        raise ConfigError(f"{key}: cannot join the Ray cluster at '{address}': {e}") from None


def prepare_model(model: ModelConfig, output_dir: str) -> str:
    """Path of the initial model: ``model.path``, or a tiny model built once into the run directory."""
    if model.path is not None:
        return model.path
    from transformers.utils import logging as hf_logging

    from roll.models.tiny import TINY_MODEL_DIR, save_tiny_model

    hf_logging.disable_progress_bar()  # one shard of a tiny model needs no progress bar
    return str(save_tiny_model(model.tiny, Path(output_dir) / TINY_MODEL_DIR))


def reserve_devices(roles: Sequence[RoleDevices], timeout_s: float) -> DeviceTable | None:
    """The cluster's device table, reserved until the run removes it; None when no role has a device
    mapping (CPU ranks). A mapping beyond the cluster's devices is a ConfigError, before any model loads."""
    from roll.config.loader import ConfigError
    from roll.distributed.device_mapping import validate_plan
    from roll.distributed.placement import DeviceTable

    if all(role.device_mapping is None for role in roles):
        return None
    table = DeviceTable.create(timeout_s=timeout_s)
    problems = validate_plan(list(roles), table.num_devices)
    if problems:
        table.remove()
        raise ConfigError("invalid device mapping:\n" + "\n".join(f"  - {p}" for p in problems))
    return table


def setup_with_rendezvous(cluster: Cluster, blocking: bool = True) -> Any:
    """Run ``setup`` on every rank of a cluster whose ranks form a process group (a trainer, a sharded
    reference); several ranks first agree on rank 0's rendezvous."""
    master_addr, master_port = cluster.master_address() if cluster.world_size > 1 else (None, None)
    return cluster.setup(master_addr=master_addr, master_port=master_port, blocking=blocking)


def prompt_batch(prompts: PromptSet, indices: list[int], pad_id: int) -> Batch:
    """``prompt_ids``/``prompt_mask`` (left-padded) plus ``prompt_text`` and the raw ``sample`` rows."""
    ids, mask = left_pad([prompts.token_ids[i] for i in indices], pad_id)
    images = {IMAGES: [prompts.vision_inputs(i) for i in indices]} if prompts.images is not None else {}
    return Batch(
        tensors={"prompt_ids": ids, "prompt_mask": mask},
        non_tensors={
            "prompt_text": [prompts.texts[i] for i in indices],
            "sample": [prompts.rows[i] for i in indices],
            **images,
        },
    )


def response_tensors(
    tokenizer: Any, responses: list[str], length: int | None = None
) -> dict[str, torch.Tensor]:
    """Target responses followed by EOS, right-padded: what the model should emit (SFT)."""
    ids = [
        tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for text in responses
    ]
    response_ids, response_mask = right_pad(ids, tokenizer.pad_token_id, length)
    return {"response_ids": response_ids, "response_mask": response_mask}


GenerateFn = Callable[[Batch, SamplingParams], Batch]
ScoreFn = Callable[[Batch], torch.Tensor]


def evaluate(
    prompts: PromptSet,
    generate: GenerateFn,
    score: ScoreFn,
    params: SamplingParams,
    batch_size: int,
    pad_id: int,
    max_prompts: int | None = None,
    divisor: int = 1,
) -> dict[str, float]:
    """Greedy decoding on held-out prompts: mean reward as ``eval/score``, response length, wall time."""
    start_time = time.perf_counter()
    count = min(len(prompts), max_prompts or len(prompts))
    scores, lengths = [], []
    for start in range(0, count, batch_size):
        batch = prompt_batch(prompts, list(range(start, min(start + batch_size, count))), pad_id)
        # The padding rows stay through scoring (the reward workers split the batch too), then go.
        padded, _ = batch.pad_to_divisor(divisor)
        scored = padded.union(generate(padded, params))
        scores.append(score(scored)[: len(batch)])
        lengths.append(scored["response_mask"][: len(batch)].sum(dim=1).float())
    return {
        "eval/score": torch.cat(scores).mean().item(),
        "eval/response_length": torch.cat(lengths).mean().item(),
        "eval/time_s": time.perf_counter() - start_time,
    }


class StageTimer:
    """Wall time per named stage of a step, reported as ``time/<stage>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{stage}_s": value for stage, value in self.seconds.items()}


def write_resolved_config(config: Any, output_dir: str) -> None:
    from roll.config import to_yaml

    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(to_yaml(config))


def checkpoint_due(checkpoints: CheckpointConfig, step: int, total_steps: int) -> bool:
    """Save every ``every_steps`` steps, after the last one, and when a stop signal asked for it."""
    from roll.utils import signals

    every = checkpoints.every_steps
    return every > 0 and (step % every == 0 or step == total_steps or signals.received() is not None)


def is_eval_step(eval_cfg: EvalConfig, step: int, total_steps: int) -> bool:
    """Evaluate every ``eval.every_steps`` steps and always after the last one."""
    return step == total_steps or bool(eval_cfg.every_steps and step % eval_cfg.every_steps == 0)


def open_tracker(config: Any, total_steps: int, resume_from: Path | None = None) -> Tracker:
    """The run's metric sinks, as its ``tracking`` section asks, in its output directory. Resuming from
    the checkpoint ``resume_from``, the trackers with runs of their own (W&B, MLflow) continue the run its
    ``tracker.json`` names: read now, since the tracker opens before the checkpoint loads."""
    return Tracker(
        config.output_dir,
        config.run_name,
        total_steps,
        config.tracking.backends,
        config.tracking.log_every,
        config=dataclasses.asdict(config),
        samples_every=config.tracking.samples_every,
        options=config.tracking,
        resume=read_tracker_state(resume_from) if resume_from is not None else None,
    )


def example_samples(batch: Batch, scores: torch.Tensor, tokenizer: Any, count: int) -> list[dict[str, Any]]:
    """Up to ``count`` rows of a training batch, as text for a reader: the first row of each of the first
    ``count`` prompt groups (padding rows skipped). Decoded for display only; nothing is trained on it."""
    real = ~batch["padding"] if "padding" in batch else torch.ones(len(batch), dtype=torch.bool)
    groups = batch["group_index"].tolist() if "group_index" in batch else list(range(len(batch)))
    seen: set[int] = set()
    rows: list[dict[str, Any]] = []
    for index in range(len(batch)):
        if len(rows) == count:
            break
        if not real[index] or groups[index] in seen:
            continue
        seen.add(groups[index])
        prompt = batch["prompt_ids"][index][batch["prompt_mask"][index].bool()]
        response = batch["response_ids"][index][batch["response_mask"][index].bool()]
        rows.append(
            {
                "prompt": tokenizer.decode(prompt.tolist()),
                "response": tokenizer.decode(response.tolist()),
                "reward": float(scores[index]),
                "response_length": len(response),
            }
        )
    return rows


def save_run_checkpoint(
    config: Any,
    step: int,
    trainers: Mapping[str, Cluster],
    driver_state: Callable[[], dict[str, Any]],
    tracker: Tracker,
) -> Path:
    """The checkpoint of ``step`` (``roll.checkpoint``): each trainer's weights, optimizer, LR schedule and
    RNGs under ``<role>/`` with its weights again in HF format under ``<role>/hf``, and the pipeline's
    ``driver_state()`` with the step and the driver's RNG in ``pipeline.pt``."""
    from roll import checkpoint
    from roll.utils import rng
    from roll.utils.signals import set_activity

    set_activity(f"saving the checkpoint of step {step}")
    start = time.perf_counter()

    def write(directory: Path) -> None:
        for role, trainer in trainers.items():
            trainer.save_state(str(directory / role))
            trainer.save_pretrained(str(directory / role / "hf"))
        state = {"step": step, "driver_rng": rng.capture(), **driver_state()}
        torch.save(state, directory / checkpoint.PIPELINE_STATE)
        tracker.save_state(directory, step)

    root = checkpoint.checkpoints_root(config.output_dir)
    path = checkpoint.save_checkpoint(root, step, write, config.checkpoint.keep_last)
    tracker.print(f"checkpoint of step {step} saved to {path} in {time.perf_counter() - start:.1f} s")
    return path


def load_run_checkpoint(path: Path, trainers: Mapping[str, Cluster]) -> dict[str, Any]:
    """Load each trainer's state from the checkpoint at ``path`` and restore the driver's RNG; returns
    the pipeline's state (``step`` and what ``save_run_checkpoint``'s ``driver_state`` gave)."""
    from roll import checkpoint
    from roll.utils import rng
    from roll.utils.signals import set_activity

    set_activity(f"loading the checkpoint {path}")
    state = torch.load(path / checkpoint.PIPELINE_STATE, weights_only=False)  # written by this code
    for role, trainer in trainers.items():
        if not (path / role).is_dir():
            raise checkpoint.CheckpointError(f"{path} holds no {role} state (was the config changed?)")
        trainer.load_state(str(path / role))
    rng.restore(state["driver_rng"])
    return state


def begin_run(
    tracker: Tracker,
    resume_from: Path | None,
    restore: Callable[[Path, dict[str, float]], int],
    evaluate_before: Callable[[], dict[str, float]] | None,
) -> tuple[int, dict[str, float]]:
    """The step a run starts after and its results so far: from the checkpoint ``resume_from`` when
    there is one (``restore`` loads it; later metric rows are cut), else 0 after the evaluation before
    training (logged as step 0), when there is one."""
    results: dict[str, float] = {}
    if resume_from is not None:
        last = restore(resume_from, results)
        tracker.rewind(last)
        tracker.print(f"resumed from {resume_from} after step {last}")
        return last, results
    if evaluate_before is not None:
        before = evaluate_before()
        tracker.log(0, before)
        results["eval/score_before"] = before["eval/score"]
    return 0, results
