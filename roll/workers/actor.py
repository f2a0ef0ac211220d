"""Actor worker: the trained policy. PPO-style RL updates, SFT updates, logprobs, generation, export."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roll.config.rlvr import AlgorithmConfig
from roll.data.batch import Batch
from roll.distributed.dispatch import Dispatch, mean_metrics
from roll.distributed.worker import register
from roll.strategies.hf_forward import response_logprobs
from roll.workers.base import ModelSpec, ModelWorker


@dataclass
class OptimizerSpec:
    lr: float
    total_steps: int
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"
    max_grad_norm: float = 1.0

    @classmethod
    def from_config(cls, section: Any, total_steps: int) -> OptimizerSpec:
        """From a config section with the usual optimizer fields (``actor`` or ``sft_warm_start``)."""
        return cls(
            lr=section.lr,
            total_steps=total_steps,
            weight_decay=section.weight_decay,
            warmup_steps=section.warmup_steps,
            lr_scheduler=section.lr_scheduler,
            max_grad_norm=section.max_grad_norm,
        )


@dataclass
class ActorSpec:
    model: ModelSpec
    optimizer: OptimizerSpec
    micro_batch_size: int = 64
    # RL only: updates per rollout batch and how the loss is built.
    ppo_epochs: int = 1
    mini_batch_size: int | None = None
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    temperature: float = 1.0
    collective_timeout_s: float = 600.0


def lr_lambda(spec: OptimizerSpec):
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


class ActorWorker(ModelWorker):
    """``config`` is an ActorSpec. With world_size > 1 the ranks form a gloo/NCCL group and all-reduce
    gradients, normalising the loss by the global token count so the update equals one big batch."""

    @register(Dispatch.ONE_TO_ALL)
    def setup(self, master_addr: str | None = None, master_port: int | None = None, **_: object) -> None:
        super().setup()
        spec: ActorSpec = self.config
        if self.world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=spec.collective_timeout_s),
            )
            # Every rank must start from identical weights even if loading were nondeterministic.
            for p in self.model.parameters():
                dist.broadcast(p.data, src=0)
        self.model.train()
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(opt))

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        if dist.is_initialized():
            # Barrier first so no rank tears the group down while a peer still uses it.
            dist.barrier()
            dist.destroy_process_group()

    # ---------------------------------------------------------------- RL
    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch policy updates over this rank's shard of the rollout batch.

        Needs ``advantages`` [B, R]; uses ``old_logprobs`` when present, else the current logprobs
        detached (exact when each batch gets a single optimizer step, and saves a forward pass), and
        ``ref_logprobs`` when ``kl_coef > 0``.
        """
        spec: ActorSpec = self.config
        mini_size = (spec.mini_batch_size or len(batch) * self.world_size) // self.world_size
        metrics: list[dict[str, float]] = []
        for _ in range(spec.ppo_epochs):
            for mini in batch.split(mini_size):
                denominator = self._global_denominator(mini, spec.algorithm.loss_agg_mode)
                step_metrics: dict[str, float] = {}
                for micro in mini.split(spec.micro_batch_size):
                    loss, loss_metrics = self._policy_loss(micro.to(self.device), denominator)
                    loss.backward()
                    _accumulate(step_metrics, loss_metrics)
                values = self._sum_loss_terms_across_ranks(_step_values(step_metrics))
                metrics.append({**values, **self._optimizer_step()})
        return mean_metrics(metrics)

    def _policy_loss(self, micro: Batch, denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss of one micro-batch (plus entropy bonus and KL penalty when configured)."""
        from roll.algorithms import POLICY_LOSSES
        from roll.algorithms.losses import entropy_loss, kl_penalty_loss

        spec: ActorSpec = self.config
        algo = spec.algorithm
        mask = micro["response_mask"].float()
        logprobs, entropy = response_logprobs(self.model, micro, spec.temperature, with_entropy=True)
        old = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()
        agg = {"loss_agg_mode": algo.loss_agg_mode, "denominator": denominator}
        loss, metrics = POLICY_LOSSES.get(algo.policy_loss)(
            logprobs,
            old,
            micro["advantages"],
            mask,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            **agg,
        )
        # Entropy is always reported; it only carries a gradient when it is part of the loss.
        entropy_term = entropy_loss(entropy if algo.entropy_coef else entropy.detach(), mask, **agg)
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * entropy_term
        if algo.kl_coef:
            kl = kl_penalty_loss(logprobs, micro["ref_logprobs"], mask, estimator=algo.kl_estimator, **agg)
            loss = loss + algo.kl_coef * kl
            metrics["kl"] = kl.item()
        return loss, {**metrics, "entropy": entropy_term.item(), "loss": loss.item()}

    # ---------------------------------------------------------------- SFT
    @register(Dispatch.DP_COMPUTE)
    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on the response tokens of this rank's shard."""
        spec: ActorSpec = self.config
        denominator = self._global_denominator(batch, "token-mean")
        total_loss = 0.0
        for micro in batch.split(spec.micro_batch_size):
            micro = micro.to(self.device)
            logprobs, _ = response_logprobs(self.model, micro)
            loss = -(logprobs * micro["response_mask"]).sum() / denominator
            loss.backward()
            total_loss += loss.item()
        return {**self._sum_loss_terms_across_ranks({"loss": total_loss}), **self._optimizer_step()}

    # ---------------------------------------------------------------- shared
    def _global_denominator(self, batch: Batch, loss_agg_mode: str) -> float:
        """Tokens (token-mean) or sequences (seq-mean-*) in the whole mini-batch, over every rank."""
        local = float(batch["response_mask"].sum()) if loss_agg_mode == "token-mean" else float(len(batch))
        if self.world_size == 1:
            return max(local, 1.0)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        return max(float(total.item()), 1.0)

    def _sum_loss_terms_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each rank holds its share of a globally normalised loss; report the whole on every rank."""
        keys = [k for k in _SUMMED_OVER_MICRO_BATCHES if k in values]
        if self.world_size == 1 or not keys:
            return values
        shares = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(shares)
        return {**values, **dict(zip(keys, shares.tolist()))}

    def _optimizer_step(self) -> dict[str, float]:
        spec: ActorSpec = self.config
        if self.world_size > 1:
            # Each rank's loss was divided by the global denominator, so summing gives the full gradient.
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        max_norm = spec.optimizer.max_grad_norm if spec.optimizer.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": lr}

    @register(Dispatch.RANK_ZERO)
    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Full weights on CPU (rank 0 only; every rank holds the same replica)."""
        if self.rank != 0:
            return None
        # Returning the tensors serialises them into Ray's object store, so no extra copy is needed here.
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    @register(Dispatch.RANK_ZERO)
    def save_pretrained(self, path: str) -> str | None:
        """Save model and tokenizer in Hugging Face format, atomically: a crash leaves no half-written dir."""
        if self.rank != 0:
            return None
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        self.model.save_pretrained(staging)
        self.tokenizer.save_pretrained(staging)
        if target.exists():
            old = target.with_name(f".{target.name}.old.{os.getpid()}")
            target.rename(old)
            staging.rename(target)
            _remove_tree(old)
        else:
            staging.rename(target)
        return str(target)


_SUMMED_OVER_MICRO_BATCHES = ("loss", "entropy", "kl")


def _accumulate(into: dict[str, float], values: dict[str, Any]) -> None:
    """Add one micro-batch's metrics to the running sums of its optimizer step."""
    into["_micro_batches"] = into.get("_micro_batches", 0) + 1
    for k, v in values.items():
        into[k] = into.get(k, 0.0) + float(v)


def _step_values(sums: dict[str, float]) -> dict[str, float]:
    """One optimizer step's metrics from its micro-batch sums: loss terms were already divided by the
    mini-batch's global denominator, so their sum is the step's value; the rest are averaged."""
    count = sums.pop("_micro_batches", 1)
    return {k: v if k in _SUMMED_OVER_MICRO_BATCHES else v / count for k, v in sums.items()}


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
