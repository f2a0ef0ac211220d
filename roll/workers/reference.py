"""Reference worker: a frozen model scoring tokens (the initial policy for KL regularisation, a DPO
reference, a distillation teacher).

On several ranks the weights are sharded (FSDP2 without an optimizer): each rank reads its 1/N of them
straight from the safetensors files and all-gathers one block at a time while scoring, so a reference on
N devices holds 1/N of the model. Its ranks run every forward together, as a trainer's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import register
from roll.workers.base import ModelSpec, ModelWorker


@dataclass
class ReferenceSpec:
    """What a reference worker receives: the model it loads, and how long its ranks wait on each other."""

    model: ModelSpec
    collective_timeout_s: float = 600.0
    # Ranks sharing each packed sequence (the trained model's, ``roll.strategies.sequence_parallel``).
    sequence_parallel_size: int = 1


class ReferenceWorker(ModelWorker):
    """Holds its model unchanged; ``compute_logprobs`` gives the reference logprobs. ``config`` is a
    ReferenceSpec."""

    joins_process_group = True  # several ranks shard the weights: they need the rendezvous

    @register(Dispatch.ONE_TO_ALL)
    def setup(self, master_addr: str | None = None, master_port: int | None = None, **_: object) -> None:
        from roll.models.loading import build_causal_lm
        from roll.strategies.sequence_parallel import set_sequence_group
        from roll.strategies.sharded_load import checkpoint_index, load_sharded, whole_model_report

        spec: ReferenceSpec = self.config
        model = spec.model
        self.set_up_process()
        index = checkpoint_index(model.path) if self.world_size > 1 else None
        if index is not None or spec.sequence_parallel_size > 1:
            self.join_process_group(master_addr, master_port, spec.collective_timeout_s)
        group = self.join_sequence_group(spec.sequence_parallel_size)
        if index is None:
            self.model = self.load_model(model)
            why = "one rank" if self.world_size == 1 else "no safetensors files"
            self.load_report = whole_model_report(self.model, why)
        else:
            dtype = getattr(torch, model.dtype)
            self.model, self.load_report = load_sharded(
                lambda: build_causal_lm(model.path, model.attn_implementation, dtype),
                model.path,
                index,
                self.device,
                compute_dtype=None,  # held in the dtype it computes in: nothing to cast, no masters
                scoring_only=True,
            )
        set_sequence_group(self.model, group)
        self.model.eval()
