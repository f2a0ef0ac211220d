"""DPO: preference optimisation on chosen/rejected pairs (Rafailov et al. 2023) and its relatives.

Each step reads like the paper: a batch of pairs -> the reference policy's log-probabilities of both
completions -> one optimizer step of the preference loss, whose forward pass scores chosen and rejected
together. The reference comes from a reference worker, from a cache scored once before training, or with
LoRA from the actor's own base weights (``reference.source``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from roll.config.dpo import loss_weights
from roll.data.batch import Batch
from roll.data.padding import left_pad, right_pad
from roll.data.preferences import PreferenceSet
from roll.distributed.cluster import Cluster
from roll.pipelines.preflight import RunInputs
from roll.pipelines.reference_cache import cache_file, load_cached, model_fingerprint, save_cached
from roll.pipelines.roles import Role
from roll.pipelines.trainer_pipeline import TrainerPipeline
from roll.pipelines.worker_specs import from_section, lora_spec
from roll.strategies.hf_forward import REJECTED_IDS, REJECTED_MASK
from roll.tracking import Tracker
from roll.utils.signals import set_activity
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec, PreferenceLossSpec
from roll.workers.base import ModelSpec
from roll.workers.reference import ReferenceSpec, ReferenceWorker

# What the workers read of a batch of pairs (the rest stays in the driver).
PAIR_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", REJECTED_IDS, REJECTED_MASK)
REFERENCE_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")
# Trainer metrics logged under TRL's names as they are; the rest go under dpo/.
TRL_PREFIXES = ("rewards/", "logps/")


class DPOPipeline(TrainerPipeline):
    """Preference optimisation (``DPOConfig``): the actor and, with ``reference.source: worker``, a
    reference worker on its devices."""

    name = label = "DPO"
    saved_as = "DPO model"
    trainer_key = "actor"
    device_roles = ("actor", "reference")

    def read_inputs(self, inputs: RunInputs) -> None:
        self.train_rows: PreferenceSet = inputs.train
        self.eval_pairs: PreferenceSet | None = inputs.eval
        self.eval_prompts = inputs.task_eval
        # precomputed: each split's reference values by row, filled before the first step.
        self.cached: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def total_steps(self) -> int:
        return self.config.steps

    @property
    def evaluates(self) -> bool:
        return self.eval_pairs is not None or self.eval_prompts is not None

    @property
    def reference(self) -> Cluster | None:
        return self.role_set.get("reference")

    def roles(self) -> dict[str, Role]:
        cfg, actor = self.config, self.config.actor
        model = from_section(ModelSpec, cfg.model, path=self.model_path, seed=cfg.seed)
        spec = from_section(
            ActorSpec,
            actor,
            model=model,
            optimizer=from_section(OptimizerSpec, actor, total_steps=cfg.steps),
            loss=from_section(PreferenceLossSpec, cfg.dpo, losses=loss_weights(cfg.dpo)),
            lora=lora_spec(actor.lora),
            collective_timeout_s=cfg.ray.call_timeout_s,
        )
        roles = {"actor": Role("actor", ActorWorker, self.world_size, spec, trainer=True)}
        if cfg.reference.source == "worker":  # on the actor's devices, taking turns with it
            reference = ReferenceSpec(
                model,
                collective_timeout_s=cfg.ray.call_timeout_s,
                sequence_parallel_size=spec.sequence_parallel_size,
            )
            ranks = ("reference", ReferenceWorker, self.world_size, reference)
            roles["reference"] = Role(*ranks, replaceable=True)
        return roles

    # ----- the algorithm -------------------------------------------------------------------------------

    def on_start(self, tracker: Tracker) -> None:
        """With a precomputed reference, score (or read from the cache) every pair before the first step.
        This runs before any checkpoint loads, so the actor still holds the initial policy."""
        if self.config.reference.source != "precomputed":
            return
        splits = {"train": self.train_rows, "eval": self.eval_pairs}
        fingerprint = model_fingerprint(self.model_path)
        for split, pairs in splits.items():
            if pairs is not None:
                self.cached[split] = self._cached_reference(pairs, fingerprint, split, tracker)

    def _cached_reference(
        self, pairs: PreferenceSet, model_key: str, split: str, tracker: Tracker
    ) -> dict[str, torch.Tensor]:
        cache_dir = self.config.reference.cache_dir or str(Path(self.config.output_dir) / "reference_cache")
        path = cache_file(cache_dir, "reference", pairs.fingerprint(), model_key)
        values = load_cached(path, len(pairs))
        if values is not None:
            tracker.print(f"reference log-probabilities of the {split} pairs read from {path}")
            return values
        set_activity(f"scoring the {split} pairs with the reference policy")
        start = time.perf_counter()
        scored = [(self._reference_logps(b), b.meta["real_rows"]) for b in self._chunks(pairs)]
        values = {key: torch.cat([part[key][:real] for part, real in scored]) for key in REFERENCE_FIELDS}
        save_cached(path, values)
        tracker.print(
            f"reference log-probabilities of {len(pairs)} {split} pairs scored in "
            f"{time.perf_counter() - start:.1f} s and cached in {path}"
        )
        return values

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        indices = self.order.next_indices()
        batch = pair_batch(self.train_rows, indices, self.tokenizer.pad_token_id)
        moved: dict[str, float] = {}
        batch = batch.union(self.reference_logps(batch, "train", indices, moved))
        with self.on_device("actor", metrics=moved):
            metrics = self.actor.train_step(batch.select_keys((*PAIR_FIELDS, *REFERENCE_FIELDS)))
        out = {k if k.startswith(TRL_PREFIXES) else f"dpo/{k}": v for k, v in metrics.items()}
        out.update(moved)
        out["dpo/samples"] = len(batch)
        out["time/step_s"] = time.perf_counter() - start
        return out

    def reference_logps(
        self, batch: Batch, split: str, indices: list[int], moved: dict[str, float] | None = None
    ) -> Batch:
        """``ref_chosen_logps`` and ``ref_rejected_logps`` [B] of the pairs ``indices`` of ``split``;
        what moved on or off the devices for it is added to ``moved``."""
        if self.config.reference.source == "precomputed":
            cached = self.cached[split]
            return Batch(tensors={key: cached[key][indices] for key in REFERENCE_FIELDS})
        return self._reference_logps(batch, moved)

    def _reference_logps(self, batch: Batch, moved: dict[str, float] | None = None) -> Batch:
        """Scored now: by the reference worker, or by the actor (its base with LoRA, or its current weights
        before the first update, which are the initial policy)."""
        fields = batch.select_keys(PAIR_FIELDS)
        if self.reference is not None:
            with self.on_device("reference", metrics=moved):
                scored = self.reference.pair_logprobs(fields)
        elif self.config.actor.lora is not None:
            scored = self.actor.reference_pair_logprobs(fields)
        else:
            scored = self.actor.pair_logprobs(fields)
        return Batch(
            tensors={
                "ref_chosen_logps": scored["chosen_logps"],
                "ref_rejected_logps": scored["rejected_logps"],
            }
        )

    def _chunks(self, pairs: PreferenceSet, limit: int | None = None) -> list[Batch]:
        """The pairs in batches of ``eval.batch_size``, each padded to a multiple of the ranks and carrying
        its row ``indices`` (the padding rows are copies, cut off by ``unpadded``)."""
        count = min(len(pairs), limit or len(pairs))
        size, batches = self.config.eval.batch_size, []
        for begin in range(0, count, size):
            indices = list(range(begin, min(begin + size, count)))
            padded, _ = pair_batch(pairs, indices, self.tokenizer.pad_token_id).pad_to_divisor(
                self.config.actor.world_size
            )
            padded.meta["real_rows"] = len(indices)
            batches.append(padded)
        return batches

    # ----- evaluation ----------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Held-out preference accuracy and margins (``eval/rewards/*``), and the greedy task score on
        ``eval.prompts_path`` as ``eval/score``; without task prompts ``eval/score`` is the accuracy."""
        metrics: dict[str, float] = {}
        if self.eval_pairs is not None:
            metrics.update(self._preference_eval())
        if self.eval_prompts is not None:
            metrics.update(self.task_score(self.eval_prompts))
        else:
            metrics["eval/score"] = metrics["eval/rewards/accuracies"]
        return metrics

    def _preference_eval(self) -> dict[str, float]:
        from roll.algorithms.preference import PairLogps, preference_metrics

        assert self.eval_pairs is not None
        parts: dict[str, list[torch.Tensor]] = {}
        batches = self._chunks(self.eval_pairs, self.config.eval.max_pairs)
        # The reference's pass over every batch first, then the policy's: one turn each on shared devices.
        references, offset = [], 0
        for batch in batches:
            real = batch.meta["real_rows"]
            references.append(self.reference_logps(batch, "eval", list(range(offset, offset + real))))
            offset += real
        with self.on_device("actor"):
            policies = [self.actor.pair_logprobs(batch.select_keys(PAIR_FIELDS)) for batch in batches]
        for batch, policy, reference in zip(batches, policies, references):
            real = batch.meta["real_rows"]
            for key, tensor in (
                ("chosen", policy["chosen_logps"]),
                ("rejected", policy["rejected_logps"]),
                ("ref_chosen", reference["ref_chosen_logps"]),
                ("ref_rejected", reference["ref_rejected_logps"]),
            ):
                parts.setdefault(key, []).append(tensor[:real])
        whole = {key: torch.cat(values) for key, values in parts.items()}
        ones = torch.ones_like(whole["chosen"])
        logps = PairLogps(
            whole["chosen"], whole["rejected"], whole["ref_chosen"], whole["ref_rejected"], ones, ones
        )
        return {f"eval/{k}": v for k, v in preference_metrics(logps, self.config.dpo.beta).items()}


def pair_batch(pairs: PreferenceSet, indices: list[int], pad_id: int) -> Batch:
    """Rows ``indices`` of ``pairs``: the prompt left-padded, the chosen completion as the response and
    the rejected one beside it, both right-padded."""
    prompt_ids, prompt_mask = left_pad([pairs.prompt_ids[i] for i in indices], pad_id)
    chosen_ids, chosen_mask = right_pad([pairs.chosen_ids[i] for i in indices], pad_id)
    rejected_ids, rejected_mask = right_pad([pairs.rejected_ids[i] for i in indices], pad_id)
    return Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": chosen_ids,
            "response_mask": chosen_mask,
            REJECTED_IDS: rejected_ids,
            REJECTED_MASK: rejected_mask,
        }
    )
