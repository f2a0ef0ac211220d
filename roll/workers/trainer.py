"""``TrainerWorker``: what every trained model shares (actor and critic). FSDP2 over several ranks, AdamW
with a warmup/decay schedule, mini-batch updates with gradient accumulation normalised across ranks, fixed
or token-budget micro-batches, offload between colocated stages, atomic HF-format save."""

from __future__ import annotations

import abc
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch, is_max_metric, mean_metrics
from roll.distributed.worker import register
from roll.workers.base import ModelSpec, ModelWorker

logger = logging.getLogger("roll")


@dataclass
class OptimizerSpec:
    lr: float
    total_steps: int
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"
    max_grad_norm: float = 1.0


@dataclass
class TrainerSpec:
    model: ModelSpec
    optimizer: OptimizerSpec
    micro_batch_size: int = 64
    # Dynamic micro-batches: pack rows up to this many real tokens per forward/backward instead.
    micro_batch_tokens: int | None = None
    # RL only: optimizer steps per rollout batch are ppo_epochs x (batch / mini_batch_size).
    ppo_epochs: int = 1
    mini_batch_size: int | None = None
    # RL on batches whose row count varies per step (step-wise agentic: one row per turn): each epoch
    # splits this rank's rows into this many equal mini-batches instead, so the number of optimizer steps
    # (and so the LR schedule) does not depend on the episodes' lengths. The batch arrives padded to a
    # multiple of world_size x mini_batches_per_epoch rows.
    mini_batches_per_epoch: int | None = None
    collective_timeout_s: float = 600.0
    # A step whose gradient norm is NaN or infinite: "skip" leaves weights, optimizer and LR schedule
    # untouched (counted in ``skipped_frac``); "stop" raises NonFiniteGradientError.
    nonfinite_grads: str = "skip"
    # Recompute each block's activations in backward (transformers' non-reentrant checkpointing).
    gradient_checkpointing: bool = False
    # Ranks sharing each packed sequence (``roll.strategies.sequence_parallel``); they get the same rows.
    sequence_parallel_size: int = 1
    # No gradient into a vision-language model's vision tower (``roll.strategies.vision``).
    freeze_vision_tower: bool = True


class NonFiniteGradientError(RuntimeError):
    """A gradient norm was NaN or infinite and ``nonfinite_grads`` is ``stop``."""


class NonFiniteWeightsError(RuntimeError):
    """The weights hold NaN or infinity; such a state is never written to a checkpoint."""


def lr_lambda(spec: OptimizerSpec) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step ``s``: linear warmup, then constant/linear/cosine decay."""

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
        if spec.lr_scheduler == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


LossFn = Callable[[Batch, float], tuple[torch.Tensor, dict[str, float]]]

# Loss terms divided by the mini-batch's global denominator: their sum over micro-batches and ranks is
# the step's value. Every other metric is averaged.
SUMMED_OVER_MICRO_BATCHES = ("loss", "entropy", "kl", "divergence", "cross_entropy", "teacher_kl")


class TrainerWorker(ModelWorker):
    """``config`` is a TrainerSpec. With world_size > 1 the ranks form a gloo/NCCL group and all-reduce
    gradients, normalising the loss by the global token (or sequence) count so the update equals one
    big batch. Weights and optimizer state are float32; ``model.dtype`` bfloat16 computes in it (mixed
    precision, see ``roll.strategies.fsdp.shard_model``)."""

    joins_process_group = True

    @register(Dispatch.ONE_TO_ALL)
    def setup(self, master_addr: str | None = None, master_port: int | None = None, **_: object) -> None:
        from roll.strategies.sharded_load import checkpoint_index, load_sharded, whole_model_report

        spec: TrainerSpec = self.config
        compute_dtype = getattr(torch, spec.model.dtype)
        mixed = compute_dtype != torch.float32
        self.set_up_process()
        sharded = self.world_size > 1 or mixed
        index = checkpoint_index(spec.model.path) if sharded else None
        if sharded:
            self.join_process_group(master_addr, master_port, spec.collective_timeout_s)
        self.sequence_group = self.join_sequence_group(spec.sequence_parallel_size)
        if index is not None:
            # Each rank reads only its shard from the files: no rank holds the whole model.
            self.model, self.load_report = load_sharded(
                self.model_builder(spec.model),
                spec.model.path,
                index,
                self.device,
                compute_dtype if mixed else None,
                self._prepare,
                stored_as=self.stored_as,
                new_weight=self.new_weight,
            )
        else:
            self.model = self.load_model(spec.model)
            self._prepare(self.model)
            why = "no safetensors files"
            self.load_report = whole_model_report(self.model, why if sharded else "one float32 rank")
            if sharded:
                from roll.strategies.fsdp import shard_model

                if self.rank == 0:
                    logger.info("%s: every rank loads the whole model before sharding (%s)", self.role, why)
                if self.world_size > 1:  # identical starting weights even if loading were nondeterministic
                    for p in self.model.parameters():
                        dist.broadcast(p.data, src=0)
                self.model = shard_model(self.model, compute_dtype if mixed else None)
        from roll.strategies.fsdp import settle_gradient_dtypes
        from roll.strategies.lora import is_lora
        from roll.strategies.sequence_parallel import set_sequence_group

        if sharded and is_lora(self.model):
            settle_gradient_dtypes(self.model, self.device)
        set_sequence_group(self.model, self.sequence_group)
        self.model.train()
        opt = spec.optimizer
        # The fused kernel updates every tensor in one pass instead of a loop of small kernels per tensor
        # (docs/performance.md); sharded (DTensor) parameters keep the default implementation.
        # Frozen weights (a LoRA base) get no optimizer state: Adam's two moments cost 8 bytes a weight.
        from roll.strategies.fsdp import is_sharded

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        fused = not any(is_sharded(p) for p in trainable)
        self.optimizer = torch.optim.AdamW(trainable, lr=opt.lr, weight_decay=opt.weight_decay, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(opt))

    @abc.abstractmethod
    def model_builder(self, spec: ModelSpec) -> Callable[[], torch.nn.Module]:
        """What builds this trainer's model from its config alone, for sharded loading (``load_model``
        is its whole-model twin)."""

    def stored_as(self, name: str) -> str:
        """The name a weight of the built model has in the checkpoint files (sharded loading)."""
        return name

    def new_weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The whole initial value of a weight the checkpoint lacks (the same on every rank), or None: a
        weight that must be in the files (sharded loading)."""
        return None

    def _prepare(self, model: torch.nn.Module) -> None:
        """Before sharding: gradient checkpointing (FSDP2 then wraps the checkpointed blocks, and
        non-reentrant recomputation gathers a block's weights again in backward like any other use), and
        a frozen vision tower."""
        if self.config.freeze_vision_tower:
            from roll.strategies.vision import freeze_vision_tower

            freeze_vision_tower(model)
        if self.config.gradient_checkpointing:
            # transformers renamed it in 5.x; the old name warns there, and is all that 5.0 has.
            enable = getattr(model, "activation_checkpointing_enable", None)
            enable = enable or model.gradient_checkpointing_enable
            enable({"use_reentrant": False})

    def weights_dtype(self, spec: ModelSpec) -> str:
        """float32 whatever the model computes in: the master weights the optimizer updates (a bf16 weight
        cannot take an update below 1/256 of itself: at lr 1e-6 almost none changed)."""
        return "float32"

    def update(self, batch: Batch, loss_fn: LossFn, loss_agg_mode: str) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch updates over this rank's shard of the batch.

        ``loss_fn(micro_batch, denominator)`` returns the micro-batch's loss, already divided by
        ``denominator`` (the whole mini-batch's count over every rank, see ``aggregation_count``), so
        accumulating micro-batch gradients and summing them across ranks gives the big-batch gradient.
        """
        spec: TrainerSpec = self.config
        if spec.mini_batches_per_epoch is not None:
            minis = batch.chunk(spec.mini_batches_per_epoch)
        else:
            # The ranks of a sequence group hold the same rows: a mini-batch is split over groups.
            groups = self.world_size // self.sequence_group.size
            minis = batch.split((spec.mini_batch_size or len(batch) * groups) // groups)
        metrics = [
            self.step_on(mini, loss_fn, loss_agg_mode) for _ in range(spec.ppo_epochs) for mini in minis
        ]
        return mean_metrics(metrics)

    def step_on(self, batch: Batch, loss_fn: LossFn, loss_agg_mode: str) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's shard of a mini-batch), in micro-batches."""
        denominator = self.global_denominator(batch, loss_agg_mode)
        # FSDP averages gradients over ranks; the loss is already a share of the global sum, so undo that.
        # (Asking FSDP for a plain sum instead needs PREMUL_SUM, which gloo lacks.)
        # The ranks of a sequence group each hold a part of their rows' gradient, summing to it.
        scale = float(self.world_size)
        step_metrics: dict[str, float] = {}
        for micro in self.micro_batches(batch):
            loss, loss_metrics = loss_fn(micro.to(self.device), denominator)
            (loss * scale).backward()
            _accumulate(step_metrics, loss_metrics)
        values = self._sum_loss_terms_across_ranks(_step_values(step_metrics))
        return {**values, **self._optimizer_step()}

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """``micro_batch_size`` rows each, or with ``micro_batch_tokens`` as many rows as fit that many real
        tokens. Sharded ranks run forward/backward in lockstep, so every rank makes as many micro-batches
        as the rank that needs the most."""
        from roll.data.micro_batches import (
            balanced_split,
            count_for_budget,
            fixed_split,
            row_tokens,
            trim_prompt_padding,
        )

        spec: TrainerSpec = self.config
        if spec.micro_batch_tokens is None:
            groups = fixed_split(len(batch), spec.micro_batch_size)
        else:
            tokens = row_tokens(batch)
            count = count_for_budget(tokens, spec.micro_batch_tokens)
            if self.world_size > 1:
                most = torch.tensor([count])
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
                count = int(most.item())
            groups = balanced_split(tokens, count)
        return [trim_prompt_padding(batch.select(rows)) for rows in groups]

    def global_denominator(self, batch: Batch, loss_agg_mode: str) -> float:
        """The aggregation mode's count (trained tokens, sequences, ...) of ``batch``, summed over ranks."""
        from roll.algorithms.aggregation import aggregation_count
        from roll.data.masks import loss_mask

        local = float(aggregation_count(loss_agg_mode, loss_mask(batch)))
        if self.world_size == 1:
            return max(local, 1.0)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        # The ranks of a sequence group hold the same rows: count them once.
        return max(float(total.item()) / self.sequence_group.size, 1.0)

    def _sum_loss_terms_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each rank holds its share of a globally normalised loss; report the whole on every rank."""
        keys = [k for k in SUMMED_OVER_MICRO_BATCHES if k in values]
        if self.world_size == 1 or not keys:
            return values
        shares = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(shares)
        shares /= self.sequence_group.size  # each group's share is on each of its ranks
        return {**values, **dict(zip(keys, shares.tolist()))}

    def _optimizer_step(self) -> dict[str, float]:
        from roll.strategies.fsdp import clip_grad_norm

        spec: TrainerSpec = self.config
        grad_norm = clip_grad_norm(self.model, spec.optimizer.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        # The norm is global (every rank's shard), so all ranks take the same branch.
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not finite and spec.nonfinite_grads == "stop":
            raise NonFiniteGradientError(
                f"{self.role} rank {self.rank}: the gradient norm is {grad_norm} at optimizer step "
                f"{self.scheduler.last_epoch}; the update was not applied. Lower the learning rate, or "
                f"set {self.role}.nonfinite_grads=skip to skip such updates and go on"
            )
        return {"grad_norm": grad_norm, "lr": lr, "skipped_frac": 0.0 if finite else 1.0}

    # ---------------------------------------------------------------- checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_state(self, path: str) -> None:
        """Write weights, optimizer, LR schedule and RNG states under ``path`` (every rank takes part):
        a torch distributed checkpoint of the (sharded) weights and optimizer in ``path/dcp``, each rank's
        schedule and RNG in ``path/rank_<r>.pt``.

        Raises:
            NonFiniteWeightsError: some weight is NaN or infinite (nothing is written).
        """
        import torch.distributed.checkpoint as dcp

        from roll.utils import rng

        self._check_finite_weights()
        model_state, optim_state = self._model_and_optimizer_state()
        with _one_process_is_fine():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=Path(path) / "dcp")
        extra = {"lr_scheduler": self.scheduler.state_dict(), "rng": rng.capture()}
        torch.save(extra, Path(path) / f"rank_{self.rank}.pt")

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote under ``path`` (same world size: RNG states are per rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from roll.utils import rng

        rank_file = Path(path) / f"rank_{self.rank}.pt"
        if not rank_file.is_file():
            raise FileNotFoundError(
                f"{rank_file} is missing: the checkpoint was written by fewer {self.role} ranks than the "
                f"{self.world_size} configured; resume with the world size it was written with"
            )
        model_state, optim_state = self._model_and_optimizer_state()
        state = {"model": model_state, "optim": optim_state}
        with _one_process_is_fine():
            dcp.load(state, checkpoint_id=Path(path) / "dcp")
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._state_options(),
        )
        extra = torch.load(rank_file, weights_only=False)
        self.scheduler.load_state_dict(extra["lr_scheduler"])
        rng.restore(extra["rng"])

    def _model_and_optimizer_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The (sharded) state a checkpoint holds: every weight and the optimizer, or with LoRA the adapter
        alone (a tied head would otherwise come along as a frozen weight under a second name)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        if self._state_options().ignore_frozen_params:
            trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
            model_state = {name: value for name, value in model_state.items() if name in trained}
        return model_state, optim_state

    def _state_options(self) -> Any:
        """With LoRA a checkpoint holds the adapter and its optimizer state only: the frozen base is the
        model the run started from, loaded again from its directory (docs/checkpoints.md has the sizes).
        Loading then sets the adapter alone (not strict); ``dcp.load`` has already checked that all of it
        is there."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from roll.strategies.lora import is_lora

        lora = is_lora(self.model)
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _check_finite_weights(self) -> None:
        from roll.strategies.fsdp import local_tensor

        bad = [name for name, p in self.model.named_parameters() if not torch.isfinite(local_tensor(p)).all()]
        flag = torch.tensor([float(len(bad))])
        if self.world_size > 1:  # every rank must refuse together, or the others would wait in dcp.save
            dist.all_reduce(flag)
        if flag.item():
            names = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
            where = f" ({names} on rank {self.rank})" if bad else ""
            raise NonFiniteWeightsError(
                f"{self.role}: the weights hold NaN or infinity{where}; the checkpoint was not written"
            )

    def _offloaded_states(self) -> list[dict]:
        """The optimizer's moments go with the model (for Adam, twice the float32 weights)."""
        return list(self.optimizer.state.values())

    @register(Dispatch.RANK_ZERO)
    def save_pretrained(self, path: str, dtype: str | None = None) -> str | None:
        """Save the whole model and tokenizer in Hugging Face format, atomically: a crash leaves no
        half-written dir. Sharded weights are gathered to rank 0 first (every rank takes part). With LoRA
        the adapter is saved instead, in peft's format, naming its base model (``roll export --merge``
        writes the merged model). ``dtype``: the saved weights' (default ``model.dtype``; ``float32``
        keeps the master weights, for a run that trains on from them)."""
        from roll.strategies.fsdp import full_state_dict, unwrapped_class_name
        from roll.strategies.lora import adapter_state, is_lora, save_adapter

        lora = is_lora(self.model)
        state = adapter_state(self.model) if lora else full_state_dict(self.model)
        if self.rank != 0:
            return None
        # The model is saved in the dtype it computes in (what the user asked for); checkpoints keep the
        # float32 weights. An adapter stays float32, as peft saves it.
        saved_dtype = dtype or self.config.model.dtype
        dtype = getattr(torch, saved_dtype)
        if not lora and dtype != torch.float32:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        if lora:
            save_adapter(self.model, state, staging)
        else:
            self.model.save_pretrained(staging, state_dict=state)
            _fix_config(staging, unwrapped_class_name(self.model), saved_dtype)
        self.tokenizer.save_pretrained(staging)
        from roll.models.loading import copy_processor_files

        copy_processor_files(self.config.model.path, staging)  # a vision-language model's image processor
        if target.exists():
            old = target.with_name(f".{target.name}.old.{os.getpid()}")
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(target)
        return str(target)


@contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """A single rank has no process group, and torch's checkpoint warns about it on every save."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fix_config(directory: Path, class_name: str, dtype: str) -> None:
    """Record the real class and dtype in the saved ``config.json``. FSDP2 wraps the model in a generated
    subclass (``FSDPQwen2ForCausalLM``) whose name HF would record as the architecture, and HF records the
    dtype of the float32 weights held in memory, not of the state saved."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    fixed = {**config, "architectures": [class_name], "dtype": dtype}
    if fixed != config:
        config_path.write_text(json.dumps(fixed, indent=2, sort_keys=True) + "\n")


def _accumulate(into: dict[str, float], values: dict[str, Any]) -> None:
    """Add one micro-batch's metrics to the running sums of its optimizer step."""
    into["_micro_batches"] = into.get("_micro_batches", 0) + 1
    for k, v in values.items():
        into[k] = max(into.get(k, float(v)), float(v)) if is_max_metric(k) else into.get(k, 0.0) + float(v)


def _step_values(sums: dict[str, float]) -> dict[str, float]:
    """One optimizer step's metrics from its micro-batch sums: loss terms are summed, maxima kept, the rest
    averaged."""
    count = sums.pop("_micro_batches", 1)
    return {
        k: v if k in SUMMED_OVER_MICRO_BATCHES or is_max_metric(k) else v / count for k, v in sums.items()
    }
