"""Offload between colocated stages goes through host buffers allocated once and reused (pinned on CUDA).

This machine has no accelerator, so ``on_accelerator`` is made to call the CPU tensors device tensors and
a clone stands in for the copy back to the device; the GPU check (``benchmarks/gpu_check.py``) measures the
real copies."""

from __future__ import annotations

import pytest
import torch
from in_process_actor import Actor, weights

import roll.strategies.offload as offload
from roll.data.batch import Batch
from roll.strategies.fsdp import is_sharded, local_tensor


def storage(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).data_ptr()


def back_on_device(module: torch.nn.Module, states: list[dict]) -> None:
    """What reload does on a GPU: every tensor in new device memory (here, a new CPU tensor)."""
    module._apply(lambda tensor: tensor.clone())
    for state in states:
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[key] = value.clone()


def test_offload_reuses_its_buffers_and_the_sharded_training_state_survives(
    tiny_model_path: str, sft_batch: Batch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 compute shards the one-rank actor with FSDP2, so the weights and Adam's moments are
    DTensors: offloaded twice (the second time into the same buffers), training goes on exactly as
    without offload."""
    with Actor(tiny_model_path, "bfloat16", lr=1e-2) as actor:
        actor.train_step(sft_batch)
        actor.train_step(sft_batch)
        expected = weights(actor)

    buffers = offload.HostBuffers()

    def on_accelerator(tensor: torch.Tensor) -> bool:  # "on the device" = not yet in a host buffer
        return tensor.dim() > 0 and storage(tensor) not in {b.data_ptr() for b in buffers._buffers}

    monkeypatch.setattr(offload, "on_accelerator", on_accelerator)
    with Actor(tiny_model_path, "bfloat16", lr=1e-2) as actor:
        actor.train_step(sft_batch)
        params = list(dict.fromkeys(actor.model.parameters()))
        assert is_sharded(params[0])
        states = actor._offloaded_states()
        moments = [v for state in states for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        tensors = [*params, *actor.model.buffers(), *moments]
        expected_bytes = sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)

        assert buffers.offload(actor.model, states) == expected_bytes
        first = [storage(p) for p in params]
        held = {b.data_ptr() for b in buffers._buffers}
        assert set(first) <= held  # the weights now live in the buffers

        back_on_device(actor.model, states)
        assert not {storage(p) for p in params} & held
        assert buffers.offload(actor.model, actor._offloaded_states()) == expected_bytes
        assert [storage(p) for p in params] == first  # the same buffers, nothing allocated
        assert {b.data_ptr() for b in buffers._buffers} == held

        back_on_device(actor.model, states)
        actor.train_step(sft_batch)
        after = weights(actor)
    for name, tensor in expected.items():
        torch.testing.assert_close(after[name], tensor, atol=0, rtol=0)


def test_a_cpu_worker_offloads_nothing(tiny_model_path: str) -> None:
    with Actor(tiny_model_path, "float32") as actor:
        before = [p.data_ptr() for p in actor.model.parameters()]
        assert actor.offload_states()["bytes"] == 0 and actor.reload_states()["bytes"] == 0
        assert [p.data_ptr() for p in actor.model.parameters()] == before
