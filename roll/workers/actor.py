"""Actor worker: the trained policy. Updates with the loss its spec selects (RL, SFT, preference,
distillation: ``roll.workers.actor_losses``), logprobs, weight transfer, export."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.data.batch import Batch
from roll.distributed.collective import CollectiveGroup
from roll.distributed.dispatch import Dispatch
from roll.distributed.shm_transfer import Endpoint, SegmentInfo, SharedWeights
from roll.distributed.sync_probe import score_after_transfer
from roll.distributed.weight_buckets import Bucket
from roll.distributed.worker import register
from roll.strategies.lora import ADAPTER, FULL, MERGED, LoraSpec, is_lora, outgoing_weights
from roll.workers.actor_losses import (
    CrossEntropySpec,
    DistillLossSpec,
    LossSpec,
    PolicyLossSpec,
    PreferenceLossSpec,
    distill_terms,
    loss_function,
)
from roll.workers.base import ModelSpec
from roll.workers.trainer import OptimizerSpec, TrainerSpec, TrainerWorker

__all__ = [
    "ActorSpec",
    "ActorWorker",
    "CrossEntropySpec",
    "DistillLossSpec",
    "LoraSpec",
    "OptimizerSpec",
    "PolicyLossSpec",
    "PreferenceLossSpec",
]


@dataclass
class ActorSpec(TrainerSpec):
    # What ``train_step`` minimises: the RL policy loss, SFT's cross-entropy, a preference or a distillation
    # loss (``roll.workers.actor_losses``), each with its own options.
    loss: LossSpec = field(default_factory=PolicyLossSpec)
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

    def model_builder(self, spec: ModelSpec) -> Callable[[], torch.nn.Module] | None:
        """The policy from its config (sharded loading); with LoRA its base in the compute dtype, wrapped
        by peft (the adapter's weights in float32, drawn by ``new_weight``)."""
        from roll.models.loading import build_causal_lm
        from roll.strategies.lora import apply_lora

        lora: LoraSpec | None = self.config.lora
        if lora is None:
            return lambda: build_causal_lm(spec.path, spec.attn_implementation)
        dtype = getattr(torch, spec.dtype)
        return lambda: _adapter_in_float32(
            apply_lora(build_causal_lm(spec.path, spec.attn_implementation, dtype), lora, spec.path)
        )

    def stored_as(self, name: str) -> str:
        from roll.strategies.lora import stored_name

        return stored_name(name) if self.config.lora is not None else name

    def new_weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        from roll.strategies.lora import initial_adapter_weight

        lora = self.config.lora is not None
        return initial_adapter_weight(name, shape, self.config.model.seed) if lora else None

    def weights_dtype(self, spec: ModelSpec) -> str:
        """With LoRA the frozen base is held in the dtype it computes in (bf16: 2 bytes a weight, as peft
        users expect); only the adapter keeps float32 masters (``load_model``)."""
        return spec.dtype if self.config.lora is not None else super().weights_dtype(spec)

    def load_model(self, spec: ModelSpec) -> torch.nn.Module:
        """The policy; with ``lora`` wrapped by peft, only the adapter trainable, in float32."""
        model = super().load_model(spec)
        lora: LoraSpec | None = self.config.lora
        if lora is None:
            return model
        from roll.strategies.lora import apply_lora

        return _adapter_in_float32(apply_lora(model, lora, spec.path))

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

    # ---------------------------------------------------------------- training
    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: Batch, kl_coef: float = 0.0) -> dict[str, float]:
        """Updates on this rank's shard of ``batch`` with the loss ``ActorSpec.loss`` selects: ``ppo_epochs``
        passes of mini-batch updates (one optimizer step per batch unless RL sets more), every term counting
        the tokens of ``loss_mask`` (``roll.data.masks``) only. ``kl_coef``: the RL loss's KL term weight for
        this step (the pipeline adapts it; 0 when the KL is in the reward instead)."""
        spec: ActorSpec = self.config
        options: dict[str, Any] = {"spec": spec.loss}
        if isinstance(spec.loss, PolicyLossSpec):
            options.update(temperature=spec.temperature, kl_coef=kl_coef)
        elif kl_coef:
            raise ValueError(
                f"kl_coef is a policy loss's option; this actor trains {type(spec.loss).__name__}"
            )
        loss_fn = functools.partial(loss_function(spec.loss), self.model, **options)
        return self.update(batch, loss_fn, spec.loss.loss_agg_mode)

    @register(Dispatch.DP_COMPUTE)
    def teacher_divergence(self, batch: Batch) -> Batch:
        """Held-out, for a distillation student: per row, the summed forward KL from the teacher
        (``teacher_kl_sum``) and the cross-entropy (``nll_sum``) over the trained tokens, and their count
        (``tokens``); no gradient."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                _, kl, logprobs, mask = distill_terms(self.model, batch.to(self.device), self.config.loss)
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


def _adapter_in_float32(model: torch.nn.Module) -> torch.nn.Module:
    """The trainable (adapter) weights in float32: the optimizer's masters, so that an update below
    bf16's step does not vanish."""
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model
