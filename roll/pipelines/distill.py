"""Offline distillation: a student trained to match a teacher's next-token distributions on a dataset's
completions (Hinton et al. 2015; top-k and generalized JSD as in GKD, Agarwal et al. 2024).

Before the first step a teacher worker scores every completion once, keeping its top k tokens per position,
and the result is cached on disk (keyed by the data, the teacher, k and the tail); the teacher then stops, so
training holds the student alone. Each step: a batch of rows -> the student's distribution on the teacher's
support -> one optimizer step of the divergence (plus a cross-entropy weight).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from roll.data.batch import Batch
from roll.data.columns import ANSWER
from roll.data.prompts import PromptSet
from roll.pipelines.common import prompt_batch, response_tensors
from roll.pipelines.preflight import RunInputs
from roll.pipelines.reference_cache import cache_file, load_cached, model_fingerprint, save_cached
from roll.pipelines.roles import Role
from roll.pipelines.trainer_pipeline import TrainerPipeline
from roll.pipelines.worker_specs import from_section
from roll.tracking import Tracker
from roll.utils.signals import set_activity
from roll.workers.actor import ActorSpec, ActorWorker, DistillLossSpec, OptimizerSpec
from roll.workers.base import ModelSpec
from roll.workers.reference import ReferenceSpec, ReferenceWorker

TEACHER_FIELDS = ("teacher_indices", "teacher_logprobs")
STUDENT_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", *TEACHER_FIELDS)


class DistillPipeline(TrainerPipeline):
    """Offline distillation (``DistillConfig``): the student is the trained ``actor``; the teacher
    scores on its devices before the first step, then stops."""

    name = label = "distillation"
    device_roles = ("actor", "teacher")
    saved_as = "student"

    def read_inputs(self, inputs: RunInputs) -> None:
        self.train_rows: PromptSet = inputs.train
        self.eval_prompts: PromptSet | None = inputs.eval
        # Each split's teacher outputs by row: lists of [T_i, k] ids and [T_i, S] log-probabilities.
        self.teacher: dict[str, dict[str, list[torch.Tensor]]] = {}

    def roles(self) -> dict[str, Role]:
        cfg, train = self.config, self.config.train
        spec = from_section(
            ActorSpec,
            train,
            model=from_section(ModelSpec, cfg.model, path=self.model_path, seed=cfg.seed),
            optimizer=from_section(OptimizerSpec, train, total_steps=train.steps),
            loss=from_section(DistillLossSpec, cfg.distill),
            collective_timeout_s=cfg.ray.call_timeout_s,
        )
        return {"actor": Role("actor", ActorWorker, self.world_size, spec, trainer=True)}

    # ----- the teacher's outputs -----------------------------------------------------------------------

    def on_start(self, tracker: Tracker) -> None:
        """The teacher's top-k outputs on every training (and held-out) completion: read from the cache, or
        scored by teacher workers started for that and stopped after."""
        cfg = self.config
        splits = {"train": self.train_rows, "eval": self.eval_prompts}
        cache_dir = cfg.distill.cache_dir or str(Path(cfg.output_dir) / "teacher_cache")
        kind = f"teacher-k{cfg.distill.top_k}-{cfg.distill.tail}"
        teacher_key = model_fingerprint(cfg.teacher.model_path)
        missing = {}
        for split, rows in splits.items():
            if rows is None:
                continue
            path = cache_file(cache_dir, kind, self._fingerprint(rows), teacher_key)
            cached = load_cached(path, len(rows))
            if cached is None:
                missing[split] = path
            else:
                self.teacher[split] = cached
                tracker.print(f"teacher outputs of the {split} rows read from {path}")
        if missing:
            self._score_with_teacher(missing, splits, tracker)

    def _score_with_teacher(self, paths: dict[str, Path], splits: dict, tracker: Tracker) -> None:
        cfg = self.config
        set_activity("starting the teacher")
        start = time.perf_counter()
        spec = ReferenceSpec(
            from_section(
                ModelSpec, cfg.model, path=cfg.teacher.model_path, dtype=cfg.model.inference(), seed=cfg.seed
            ),
            collective_timeout_s=cfg.ray.call_timeout_s,
        )
        # On the student's devices the teacher takes its turn: the student is offloaded while it scores.
        self.role_set.roles = {
            **self.role_set.roles,
            "teacher": Role("teacher", ReferenceWorker, cfg.teacher.world_size, spec),
        }
        moved = self.role_set.set_up(self.role_set.start())
        teacher = self.role_set.get("teacher")
        try:
            for split, path in paths.items():
                set_activity(f"scoring the {split} rows with the teacher")
                rows: PromptSet = splits[split]
                values: dict[str, list[torch.Tensor]] = {name: [] for name in TEACHER_FIELDS}
                for begin in range(0, len(rows), cfg.eval.batch_size):
                    indices = list(range(begin, min(begin + cfg.eval.batch_size, len(rows))))
                    batch, _ = self.batch(rows, indices, with_teacher=False).pad_to_divisor(
                        teacher.world_size
                    )
                    scored = teacher.topk_logprobs(
                        batch.select_keys(STUDENT_FIELDS[:4]), cfg.distill.top_k, cfg.distill.tail
                    )
                    lengths = batch["response_mask"].sum(dim=1).tolist()
                    for row in range(len(indices)):
                        length = int(lengths[row])
                        values["teacher_indices"].append(
                            scored["teacher_indices"][row, :length].to(torch.int32)
                        )
                        values["teacher_logprobs"].append(scored["teacher_logprobs"][row, :length].float())
                save_cached(path, values)
                self.teacher[split] = values
        finally:
            back = self.role_set.retire("teacher")
        tracker.print(
            f"teacher outputs of {', '.join(paths)} scored in {time.perf_counter() - start:.1f} s and cached "
            f"in {', '.join(map(str, paths.values()))}; the teacher is stopped"
        )
        if "offload/actor_bytes" in moved:
            tracker.print(
                f"the teacher took its turn on the student's devices: the student was offloaded "
                f"({moved['offload/actor_bytes'] / 1e9:.2f} GB) and reloaded "
                f"({back.get('offload/actor_bytes', 0.0) / 1e9:.2f} GB)"
            )

    def _fingerprint(self, rows: PromptSet) -> str:
        """The rows' prompt and completion token ids, in order."""
        digest = hashlib.sha256()
        for index in range(len(rows)):
            ids = rows.token_ids[index] + [-1] + self._answer_ids(rows, [index])[0]
            digest.update(b"".join(i.to_bytes(4, "little", signed=True) for i in ids))
        return digest.hexdigest()

    def _answer_ids(self, rows: PromptSet, indices: list[int]) -> list[list[int]]:
        tensors = response_tensors(self.tokenizer, [str(rows.rows[i][ANSWER]) for i in indices])
        return [
            ids[mask.bool()].tolist() for ids, mask in zip(tensors["response_ids"], tensors["response_mask"])
        ]

    # ----- the algorithm -------------------------------------------------------------------------------

    def batch(
        self, rows: PromptSet, indices: list[int], with_teacher: bool = True, split: str = "train"
    ) -> Batch:
        """Rows ``indices``: prompts, the dataset's completions as responses, and the teacher's outputs at
        each completion position (zeros past its end)."""
        batch = prompt_batch(rows, indices, self.tokenizer.pad_token_id)
        answers = [str(rows.rows[i][ANSWER]) for i in indices]
        for name, tensor in response_tensors(self.tokenizer, answers).items():
            batch[name] = tensor
        if with_teacher:
            width = batch["response_ids"].shape[1]
            for name in TEACHER_FIELDS:
                per_row = [self.teacher[split][name][i] for i in indices]
                batch[name] = torch.stack([_pad_rows(t, width) for t in per_row])
        return batch

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        batch = self.batch(self.train_rows, self.order.next_indices())
        metrics = {
            f"distill/{k}": v for k, v in self.actor.train_step(batch.select_keys(STUDENT_FIELDS)).items()
        }
        metrics["distill/samples"] = len(batch)
        metrics["time/step_s"] = time.perf_counter() - start
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Greedy answers to the held-out prompts scored by ``reward`` (``eval/score``), and the student's
        forward KL from the teacher and cross-entropy on the held-out completions, per token
        (``eval/teacher_kl``, ``eval/nll``)."""
        assert self.eval_prompts is not None
        cfg = self.config
        metrics = self.task_score(self.eval_prompts)
        count = min(len(self.eval_prompts), cfg.eval.max_prompts or len(self.eval_prompts))
        sums = {"teacher_kl_sum": 0.0, "nll_sum": 0.0, "tokens": 0.0}
        for begin in range(0, count, cfg.eval.batch_size):
            indices = list(range(begin, min(begin + cfg.eval.batch_size, count)))
            batch, _ = self.batch(self.eval_prompts, indices, split="eval").pad_to_divisor(
                cfg.train.world_size
            )
            scored = self.actor.teacher_divergence(batch.select_keys(STUDENT_FIELDS))
            for key in sums:
                sums[key] += scored[key][: len(indices)].sum().item()
        metrics["eval/teacher_kl"] = sums["teacher_kl_sum"] / max(1.0, sums["tokens"])
        metrics["eval/nll"] = sums["nll_sum"] / max(1.0, sums["tokens"])
        return metrics


def _pad_rows(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` [T, ...] with zero rows appended up to ``width``."""
    if len(values) >= width:
        return values[:width]
    return torch.cat([values, values.new_zeros((width - len(values), *values.shape[1:]))])
