"""``ModelWorker``: a worker that holds a causal LM (actor, reference, rollout share this)."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register
from roll.strategies.requests import SamplingParams
from roll.strategies.sequence_parallel import SequenceGroup


@dataclass
class ModelSpec:
    """What every model-holding worker needs to start."""

    path: str
    dtype: str = "float32"  # what the model computes in (trainers hold float32 weights, see TrainerWorker)
    seed: int = 0
    attn_implementation: str = "sdpa"  # transformers' attention kernel (model.attn_implementation)


# The cores a run's workers may use on each node (default: all of them): set it when other work shares the
# machine, e.g. two runs, or two test processes, on one. Threads beyond the cores a process really gets make
# OpenMP's teams wait on descheduled threads, which slows every parallel region.
CPU_THREADS_ENV = "ROLL_CPU_THREADS"


def cpu_threads() -> int:
    """The threads this node's workers share (``ROLL_CPU_THREADS``, else every core)."""
    value = os.environ.get(CPU_THREADS_ENV)
    return max(1, int(value)) if value else os.cpu_count() or 1


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class ModelWorker(Worker):
    """Loads ``config.model`` (a ModelSpec) in ``setup`` and computes response logprobs."""

    model: torch.nn.Module
    joins_process_group = False  # whether ``setup`` takes a rendezvous (``master_addr``, ``master_port``)

    @register(Dispatch.ONE_TO_ALL)
    def setup(self, **_: object) -> None:
        from roll.strategies.sharded_load import whole_model_report

        self.set_up_process()
        self.model = self.load_model(self.config.model)
        self.model.eval()
        self.load_report = whole_model_report(self.model, "a replica on every rank")

    def set_up_process(self) -> None:
        """Threads, the seed, the device and the tokenizer: everything but the model."""
        from transformers.utils import logging as hf_logging

        from roll.models.loading import load_tokenizer

        # Per-shard progress bars from every worker would bury the training metrics.
        hf_logging.disable_progress_bar()
        spec: ModelSpec = self.config.model
        # The stages of a step run one after another, so one role at a time uses the node's cores (Ray
        # would otherwise pin each zero-CPU actor to a single thread); its ranks run together and split them.
        torch.set_num_threads(max(1, cpu_threads() // self.world_size))
        torch.manual_seed(spec.seed + self.rank)
        self.device = pick_device()
        self.tokenizer = load_tokenizer(spec.path)

    def join_process_group(self, master_addr: str | None, master_port: int | None, timeout_s: float) -> None:
        """The ranks' gloo/NCCL group (FSDP2 and a trainer step's bookkeeping). One rank gets a group of
        its own too, in memory: mixed precision is FSDP2's on every world size."""
        import torch.distributed as dist

        # The step's bookkeeping all-reduces CPU tensors (global denominator, micro-batch count, loss
        # terms, finite-weights flag): NCCL alone has no CPU backend, so those go over gloo.
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if self.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            return
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )

    def join_sequence_group(self, size: int) -> SequenceGroup:
        """This rank's sequence group (``roll.strategies.sequence_parallel``; every rank calls this once the
        process group is up), after checking that the model can be split so: refused before it loads."""
        from roll.strategies.sequence_parallel import check_sequence_parallel, new_sequence_group

        if size > 1:
            spec: ModelSpec = self.config.model
            check_sequence_parallel(self.role, size, self.world_size, spec.path, spec.attn_implementation)
        return new_sequence_group(size)

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            # Barrier first so no rank tears the group down while a peer still uses it.
            dist.barrier()
            dist.destroy_process_group()

    @register(Dispatch.ONE_TO_ALL)
    def loaded(self) -> dict[str, Any]:
        """How this rank loaded its model (``roll.strategies.sharded_load.LoadReport``)."""
        return dataclasses.asdict(self.load_report)

    @register(Dispatch.ONE_TO_ALL)
    def warm_up(self) -> None:
        """Import transformers and the model's class (seconds of a worker's start; loading a small
        model's weights is less), without loading anything."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(self.config.model.path)
        MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config))  # the lookup imports the class's module

    def load_model(self, spec: ModelSpec) -> torch.nn.Module:
        """The worker's model on ``self.device``: a causal LM here; the critic loads a value model."""
        from roll.models.loading import load_causal_lm

        return load_causal_lm(
            spec.path, self.weights_dtype(spec), self.device, attn_implementation=spec.attn_implementation
        )

    def weights_dtype(self, spec: ModelSpec) -> str:
        """The dtype the weights are held in: the one the model computes in (trainers keep float32)."""
        return spec.dtype

    @register(Dispatch.ONE_TO_ALL)
    def device_type(self) -> str:
        """``cuda`` or ``cpu``: where this worker computes (the weight-transfer backend follows it)."""
        return self.device.type

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self) -> dict[str, float]:
        """Move this worker's state to CPU memory while a colocated role uses the device; returns the
        bytes moved (0 when the worker already lives on the CPU) and the seconds taken."""
        return self._move_states(torch.device("cpu"))

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self) -> dict[str, float]:
        """Bring the state back to the worker's device before it is used."""
        return self._move_states(self.device)

    def _move_states(self, device: torch.device) -> dict[str, float]:
        """The model's weights, buffers and gradients (and ``_offloaded_states``) to ``device``: into
        reused host buffers (``roll.strategies.offload``) on the way out, back to the worker's device on
        the way in."""
        from roll.strategies.offload import HostBuffers

        start = time.perf_counter()
        if self.device.type == "cpu":
            return {"bytes": 0.0, "seconds": 0.0}  # a CPU worker's state has nowhere else to go
        if not hasattr(self, "_host_buffers"):
            self._host_buffers = HostBuffers()
        if device.type == "cpu":
            moved = self._host_buffers.offload(self.model, self._offloaded_states())
        else:
            moved = self._host_buffers.reload(self.model, device)
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}

    def _offloaded_states(self) -> list[dict]:
        """State dicts offloaded with the model (a trainer's optimizer state)."""
        return []

    @register(Dispatch.DP_COMPUTE)
    def compute_logprobs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """``logprobs`` [B, R] of the response tokens under this worker's current weights."""
        from roll.strategies.hf_forward import response_logprobs

        was_training = self.model.training
        self.model.eval()  # no dropout (a LoRA adapter's): the old and reference policies are deterministic
        try:
            with torch.no_grad():  # not inference_mode: FSDP writes gathered weights in place
                logprobs, _ = response_logprobs(self.model, batch.to(self.device), temperature)
        finally:
            self.model.train(was_training)
        return Batch(tensors={"logprobs": logprobs.cpu()})

    @register(Dispatch.DP_COMPUTE)
    def pair_logprobs(self, batch: Batch) -> Batch:
        """``chosen_logps`` and ``rejected_logps`` [B]: each preference pair's completions' sequence
        log-probabilities under this worker's current weights (no dropout, no gradient)."""
        from roll.strategies.hf_forward import pair_logprobs

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                chosen, rejected, _, _ = pair_logprobs(self.model, batch.to(self.device))
        finally:
            self.model.train(was_training)
        return Batch(tensors={"chosen_logps": chosen.cpu(), "rejected_logps": rejected.cpu()})

    @register(Dispatch.DP_COMPUTE)
    def topk_logprobs(self, batch: Batch, k: int, tail: str) -> Batch:
        """This model as a distillation teacher: at each response position its ``k`` most likely tokens
        (``teacher_indices`` [B, R, k]) and their log-probabilities, with the tail as ``tail`` says
        (``teacher_logprobs`` [B, R, S]; ``roll.algorithms.distillation.teacher_topk``). Zeros past each
        response."""
        from roll.algorithms.distillation import teacher_topk
        from roll.strategies.hf_forward import pad_columns, response_logits

        self.model.eval()
        with torch.no_grad():
            logits, _ = response_logits(self.model, batch.to(self.device))
            indices, logprobs = teacher_topk(logits, k, tail)
        width = batch["response_ids"].shape[1]
        # The logits run to the longest response of this rank's rows: clear the positions past each one.
        real = batch["response_mask"][:, : indices.shape[1], None].bool().to(indices.device)
        indices, logprobs = indices.masked_fill(~real, 0), logprobs.masked_fill(~real, 0.0)
        return Batch(
            tensors={
                "teacher_indices": pad_columns(indices.cpu(), width),
                "teacher_logprobs": pad_columns(logprobs.cpu(), width),
            }
        )

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample (or greedily decode) one response per prompt row with the current weights;
        see ``roll.strategies.hf_generate.generate``."""
        from roll.models.loading import end_of_sequence_ids
        from roll.strategies.cpu_threads import threads_for_decoding
        from roll.strategies.hf_generate import generate

        was_training = self.model.training
        self.model.eval()
        try:
            with threads_for_decoding(self.model, self.device):
                return generate(
                    self.model,
                    batch,
                    params,
                    end_of_sequence_ids(self.tokenizer, self.model),
                    self.tokenizer.pad_token_id,
                    self.tokenizer,
                )
        finally:
            self.model.train(was_training)
