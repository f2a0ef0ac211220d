"""Actor worker: the trained policy. PPO-style RL updates, SFT updates, logprobs, generation, export."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.data.batch import Batch
from roll.data.masks import loss_mask
from roll.distributed.collective import CollectiveGroup
from roll.distributed.dispatch import Dispatch
from roll.distributed.shm_transfer import Endpoint, SegmentInfo, SharedWeights
from roll.distributed.sync_probe import score_after_transfer
from roll.distributed.weight_buckets import Bucket
from roll.distributed.worker import register
from roll.strategies.hf_forward import response_logprobs
from roll.strategies.lora import ADAPTER, FULL, MERGED, LoraSpec, is_lora, outgoing_weights
from roll.workers.base import ModelSpec
from roll.workers.trainer import OptimizerSpec, TrainerSpec, TrainerWorker

__all__ = [
    "ActorSpec",
    "ActorWorker",
    "DistillLossSpec",
    "LoraSpec",
    "OptimizerSpec",
    "PolicyLossSpec",
    "PreferenceLossSpec",
]


@dataclass(frozen=True)
class PolicyLossSpec:
    """What the actor's loss needs of the ``algorithm`` section; fields named as there (``from_section``).

    ``tis_cap`` is resolved by the pipeline: the cap when the off-policy correction is on
    (``roll.config.rlvr.off_policy_corrected``), None when it is off."""

    policy_loss: str = "ppo_clip"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    tis_cap: float | None = None
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class PreferenceLossSpec:
    """The ``dpo`` section as the actor's preference loss reads it (``from_section``)."""

    beta: float = 0.1
    losses: dict[str, float] = field(default_factory=lambda: {"sigmoid": 1.0})
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class DistillLossSpec:
    """The ``distill`` section as the student's loss reads it (``from_section``)."""

    objective: str = "forward_kl"
    beta: float = 0.5
    tail: str = "extra_class"
    ce_weight: float = 0.0


@dataclass
class ActorSpec(TrainerSpec):
    policy: PolicyLossSpec = field(default_factory=PolicyLossSpec)
    preference: PreferenceLossSpec = field(default_factory=PreferenceLossSpec)
    distill: DistillLossSpec = field(default_factory=DistillLossSpec)
    temperature: float = 1.0
    # Train a LoRA adapter on the frozen base instead of every weight (``actor.lora``); None: full.
    lora: LoraSpec | None = None
    # The dtype a weight sync sends floating-point weights in: the rollout engine's (``model.inference``),
    # so they are rounded once, here, and travel at its size. None: as held (float32).
    sync_dtype: str | None = None


class ActorWorker(TrainerWorker):
    """``config`` is an ActorSpec."""

    weight_group: CollectiveGroup | None = None  # rank 0's end of the weight transfer, once joined
    shared_weights: SharedWeights | None = None  # rank 0's shared segment (one-node transfer), once made
    shared_plan: list[Bucket] | None = None  # the plan every rank gathers by when writing to it
    weight_payload: str = FULL  # what a sync sends (roll.strategies.lora.PAYLOADS), set by weight_plan
    probe_sequences: list[list[int]] | None = None  # scored after every sync (set_sync_probe)

    def load_model(self, spec: ModelSpec) -> torch.nn.Module:
        """The policy; with ``lora`` wrapped by peft, only the adapter trainable."""
        model = super().load_model(spec)
        lora: LoraSpec | None = self.config.lora
        if lora is None:
            return model
        from roll.strategies.lora import apply_lora

        return apply_lora(model, lora, spec.path)

    @register(Dispatch.DP_COMPUTE)
    def compute_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """The reference (initial) policy's ``logprobs`` with LoRA: the frozen base weights are that policy,
        so this is the actor's own model with its adapter switched off, and no second copy is loaded."""
        if not is_lora(self.model):
            raise RuntimeError("reference logprobs from the actor need actor.lora; use a reference worker")
        with self.model.disable_adapter():
            return self.compute_logprobs(batch, temperature)

    @register(Dispatch.DP_COMPUTE)
    def reference_pair_logprobs(self, batch: Batch) -> Batch:
        """``pair_logprobs`` of the reference (initial) policy with LoRA: the adapter switched off."""
        if not is_lora(self.model):
            raise RuntimeError("reference logprobs from the actor need actor.lora; use a reference worker")
        with self.model.disable_adapter():
            return self.pair_logprobs(batch)

    @register(Dispatch.ONE_TO_ALL)
    def set_sync_probe(self, sequences: list[list[int]] | None) -> None:
        """Score ``sequences`` after every transfer of the weights (``roll.distributed.sync_probe``)."""
        self.probe_sequences = sequences

    @register(Dispatch.RANK_ZERO)
    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Logprobs of each token after the first of each sequence under the trained weights, without
        dropout: the trainer's side of the weight-sync probe. Every rank runs the forward (FSDP)."""
        from roll.strategies.hf_forward import sequence_logprobs

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return sequence_logprobs(self.model, token_ids, self.tokenizer.pad_token_id)
        finally:
            self.model.train(was_training)

    # ---------------------------------------------------------------- RL
    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: Batch, kl_coef: float = 0.0) -> dict[str, float]:
        """Policy updates (``ppo_epochs`` x mini-batches) on this rank's shard of the rollout batch.

        Needs ``advantages`` [B, R]; uses ``old_logprobs`` when present, else the current logprobs
        detached (exact when each batch gets a single optimizer step, and saves a forward pass);
        ``ref_logprobs`` when ``kl_coef > 0`` (the KL loss term; the pipeline passes 0 when the KL is in
        the reward instead); ``rollout_logprobs`` when the off-policy correction is on
        (``policy.tis_cap``). Every term counts the tokens of ``loss_mask`` (``roll.data.masks``) only.
        """
        spec: ActorSpec = self.config
        loss_fn = functools.partial(self._policy_loss, kl_coef=kl_coef)
        return self.update(batch, loss_fn, spec.policy.loss_agg_mode)

    def _policy_loss(
        self, micro: Batch, denominator: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss of one micro-batch (plus entropy bonus and KL penalty when configured)."""
        from roll.algorithms import POLICY_LOSSES
        from roll.algorithms.losses import entropy_loss, kl_penalty_loss, truncated_is_weights
        from roll.utils.registry import accepted_kwargs

        spec: ActorSpec = self.config
        policy = spec.policy
        mask = loss_mask(micro).float()
        logprobs, entropy = response_logprobs(self.model, micro, spec.temperature, with_entropy=True)
        old = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()
        advantages = micro["advantages"]
        metrics: dict[str, float] = {}
        if policy.tis_cap is not None:
            weights, metrics = truncated_is_weights(old, micro["rollout_logprobs"], mask, policy.tis_cap)
            advantages = advantages * weights
        agg = {"loss_agg_mode": policy.loss_agg_mode, "denominator": denominator}
        loss_fn = POLICY_LOSSES.get(policy.policy_loss)
        params = {
            "clip_ratio_low": policy.clip_ratio_low,
            "clip_ratio_high": policy.clip_ratio_high,
            "clip_ratio_c": policy.clip_ratio_c,
        }
        loss, loss_metrics = loss_fn(
            logprobs, old, advantages, mask, **agg, **accepted_kwargs(loss_fn, params)
        )
        metrics.update(loss_metrics)
        # Entropy is always reported; it only carries a gradient when it is part of the loss.
        entropy_term = entropy_loss(entropy if policy.entropy_coef else entropy.detach(), mask, **agg)
        if policy.entropy_coef:
            loss = loss - policy.entropy_coef * entropy_term
        if kl_coef:
            kl = kl_penalty_loss(logprobs, micro["ref_logprobs"], mask, estimator=policy.kl_estimator, **agg)
            loss = loss + kl_coef * kl
            metrics["kl"] = kl.item()
        return loss, {**metrics, "entropy": entropy_term.item(), "loss": loss.item()}

    # ---------------------------------------------------------------- SFT
    @register(Dispatch.DP_COMPUTE)
    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on the trained response tokens (``loss_mask``)
        of this rank's shard."""
        return self.step_on(batch, self._cross_entropy, "token-mean")

    def _cross_entropy(self, micro: Batch, denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, _ = response_logprobs(self.model, micro)
        loss = -(logprobs * loss_mask(micro)).sum() / denominator
        return loss, {"loss": loss.item()}

    # ---------------------------------------------------------------- preference optimisation
    @register(Dispatch.DP_COMPUTE)
    def preference_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the preference loss (``preference``) on this rank's shard of a batch of
        pairs, which carries the reference's ``ref_chosen_logps`` and ``ref_rejected_logps``. The loss is a
        mean over the pairs of the whole batch (every rank's), so micro-batches and ranks add up to it."""
        return self.step_on(batch, self._preference_loss, "seq-mean-token-sum")

    def _preference_loss(self, micro: Batch, denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
        from roll.algorithms.preference import PairLogps, combined_preference_loss, preference_metrics
        from roll.strategies.hf_forward import pair_logprobs

        spec: PreferenceLossSpec = self.config.preference
        chosen, rejected, chosen_tokens, rejected_tokens = pair_logprobs(self.model, micro)
        logps = PairLogps(
            policy_chosen=chosen,
            policy_rejected=rejected,
            reference_chosen=micro["ref_chosen_logps"].to(chosen.dtype),
            reference_rejected=micro["ref_rejected_logps"].to(chosen.dtype),
            chosen_tokens=chosen_tokens,
            rejected_tokens=rejected_tokens,
        )
        per_pair, terms = combined_preference_loss(
            logps, spec.losses, beta=spec.beta, label_smoothing=spec.label_smoothing
        )
        loss = per_pair.sum() / denominator
        return loss, {**terms, **preference_metrics(logps, spec.beta), "loss": loss.item()}

    # ---------------------------------------------------------------- distillation
    @register(Dispatch.DP_COMPUTE)
    def distill_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the distillation loss (``distill``) on this rank's shard of a batch whose
        rows carry the teacher's ``teacher_indices`` and ``teacher_logprobs`` at each response position:
        the divergence per trained token, token-mean, plus ``ce_weight`` x the cross-entropy."""
        return self.step_on(batch, self._distill_loss, "token-mean")

    def _distill_terms(self, micro: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per trained token [B, L]: the configured divergence, the forward KL to the teacher, the response
        tokens' logprobs; and the loss mask cut to L."""
        from roll.algorithms.distillation import DISTILL_OBJECTIVES, forward_kl, student_on_support
        from roll.algorithms.functional import logprobs_from_logits
        from roll.strategies.hf_forward import response_logits

        spec: DistillLossSpec = self.config.distill
        logits, response_ids, _ = response_logits(self.model, micro)
        length = logits.shape[1]
        # No float32 copy of the logits: the support and the logprobs upcast a chunk of positions at a time.
        teacher = micro["teacher_logprobs"][:, :length].float()
        student = student_on_support(logits, micro["teacher_indices"][:, :length].long(), spec.tail)
        divergence = DISTILL_OBJECTIVES.get(spec.objective)(teacher, student, beta=spec.beta)
        mask = loss_mask(micro)[:, :length].float()
        # Zero where not trained: padding positions hold zeros, which are no distribution.
        keep = mask.bool()
        divergence = torch.where(keep, divergence, torch.zeros_like(divergence))
        kl = torch.where(keep, forward_kl(teacher, student), torch.zeros_like(divergence))
        return divergence, kl, logprobs_from_logits(logits, response_ids) * mask, mask

    def _distill_loss(self, micro: Batch, denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
        spec: DistillLossSpec = self.config.distill
        divergence, kl, logprobs, _ = self._distill_terms(micro)
        divergence_term = divergence.sum() / denominator
        cross_entropy = -logprobs.sum() / denominator
        loss = divergence_term + spec.ce_weight * cross_entropy if spec.ce_weight else divergence_term
        return loss, {
            "divergence": divergence_term.item(),
            "cross_entropy": cross_entropy.item(),
            "teacher_kl": (kl.sum() / denominator).item(),
            "loss": loss.item(),
        }

    @register(Dispatch.DP_COMPUTE)
    def teacher_divergence(self, batch: Batch) -> Batch:
        """Held-out: per row, the summed forward KL from the teacher (``teacher_kl_sum``) and the
        cross-entropy (``nll_sum``) over the trained tokens, and their count (``tokens``); no gradient."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                _, kl, logprobs, mask = self._distill_terms(batch.to(self.device))
        finally:
            self.model.train(was_training)
        return Batch(
            tensors={
                "teacher_kl_sum": kl.sum(dim=1).cpu(),
                "nll_sum": -logprobs.sum(dim=1).cpu(),
                "tokens": mask.sum(dim=1).cpu(),
            }
        )

    # ---------------------------------------------------------------- weights
    @register(Dispatch.ONE_TO_ALL)
    def weight_payloads(self) -> list[str]:
        """What this actor can send (``roll.strategies.lora.PAYLOADS``): its adapter, or the merged weights,
        with LoRA; every weight otherwise."""
        return [ADAPTER, MERGED] if is_lora(self.model) else [FULL]

    @register(Dispatch.RANK_ZERO)
    def weight_plan(self, bucket_bytes: int, payload: str = FULL) -> list[Bucket]:
        """How ``payload``'s tensors split into transfer buckets (names, full shapes, dtypes); every rank
        keeps ``payload`` for the transfers to come."""
        from roll.distributed.weight_buckets import TensorMeta, plan_buckets

        weights = outgoing_weights(self.model, payload)
        self.weight_payload = payload
        # An adapter travels as held: the engine merges it into its base in float32 and rounds once.
        cast = self.config.sync_dtype is not None and payload != ADAPTER
        sent = getattr(torch, self.config.sync_dtype) if cast else None

        def dtype(held: torch.dtype) -> torch.dtype:
            return sent if sent is not None and held.is_floating_point else held

        return plan_buckets([TensorMeta(w.name, w.shape, dtype(w.dtype)) for w in weights], bucket_bytes)

    def _tensors_for(self) -> Callable[[Bucket], dict[str, torch.Tensor]]:
        """Per bucket, its tensors made whole (gathered, and merged for the ``merged`` payload); every
        rank calls it for every bucket in plan order (each gather is a collective under FSDP)."""
        weights = {w.name: w for w in outgoing_weights(self.model, self.weight_payload)}

        def tensors_for(bucket: Bucket) -> dict[str, torch.Tensor]:
            # Cast to the plan's dtype (the engine's, see weight_plan): a no-op when they agree.
            return {meta.name: weights[meta.name].gather().to(meta.dtype) for meta in bucket.tensors}

        return tensors_for

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_group(
        self, name: str, backend: str, master_addr: str, master_port: int, group_size: int, timeout_s: float
    ) -> None:
        """Rank 0 joins the weight-transfer group as its sender (group rank 0); other ranks only help
        gather sharded weights during a transfer."""
        from roll.distributed.collective import create_group

        if self.rank == 0:
            self.weight_group = create_group(
                name, backend, master_addr, master_port, 0, group_size, timeout_s
            )

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self, plan: list[Bucket], version: int, timeout_s: float) -> dict[str, Any]:
        """Broadcast the current weights to the rollout workers, one bucket at a time. Every rank takes
        part: sharded weights are gathered bucket by bucket, so no rank ever holds the whole model twice."""
        from roll.distributed.weight_transfer import send_weights

        group = self.weight_group if self.rank == 0 else None
        on_gpu = group is not None and group.backend == "nccl"
        device = self.device if on_gpu else torch.device("cpu")
        stats = send_weights(group, plan, self._tensors_for(), version, timeout_s, device)
        return score_after_transfer(stats, self.prompt_logprobs, self.probe_sequences)

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight once, as the model holds them (a tied head is left to the receiver to tie)."""
        from roll.strategies.lora import unique_state

        return unique_state(self.model)

    # ---------------------------------------------------------------- weights through shared memory
    @register(Dispatch.ONE_TO_ALL)
    def weight_endpoint(self, shm_dir: str) -> Endpoint:
        """Where this rank runs (node, IP, device, free shared memory); rank 0's picks the transfer path."""
        from roll.distributed.shm_transfer import local_endpoint

        return local_endpoint(self.device, shm_dir)

    @register(Dispatch.ONE_TO_ALL)
    def create_shared_weights(self, plan: list[Bucket], shm_dir: str) -> tuple[SegmentInfo | None, str]:
        """Rank 0 allocates the shared segment for ``plan`` in ``shm_dir``; every rank keeps the plan (they
        all gather during a write). Returns the segment's info, or None and why it could not be made."""
        from roll.distributed.shm_transfer import SharedWeights

        self.close_shared_weights()
        self.shared_plan = plan
        if self.rank != 0:
            return None, ""
        try:
            self.shared_weights = SharedWeights.create(plan, shm_dir)
        except OSError as exc:
            return None, f"could not allocate the shared weight segment in {shm_dir}: {exc}"
        return self.shared_weights.info, ""

    @register(Dispatch.RANK_ZERO)
    def unlink_shared_weights(self) -> None:
        """Remove the segment's name once the receivers have mapped it: nothing is left on /dev/shm
        however the processes end, and the memory stays until the last mapping goes."""
        if self.shared_weights is not None:
            self.shared_weights.unlink()

    @register(Dispatch.ONE_TO_ALL)
    def write_shared_weights(self, version: int) -> dict[str, Any]:
        """Write the current weights into the shared segment as ``version`` (rank 0; the other ranks only
        help gather sharded weights, bucket by bucket)."""
        from roll.distributed.shm_transfer import write_weights

        if self.shared_plan is None:
            raise RuntimeError("no shared weight segment: call create_shared_weights first")
        stats = write_weights(self.shared_weights, self.shared_plan, self._tensors_for(), version)
        return score_after_transfer(stats, self.prompt_logprobs, self.probe_sequences)

    @register(Dispatch.ONE_TO_ALL)
    def close_shared_weights(self) -> None:
        """Drop the shared segment (and its file, if still named); idempotent."""
        if self.shared_weights is not None:
            self.shared_weights.close()
        self.shared_weights, self.shared_plan = None, None

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        from roll.distributed.collective import destroy_group

        if self.weight_group is not None:
            destroy_group(self.weight_group)
            self.weight_group = None
        self.close_shared_weights()
        super().shutdown()
